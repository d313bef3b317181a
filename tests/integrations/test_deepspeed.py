"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (gloo, DeepSpeed's CPU accelerator): the
engine's gradient under every recipe against one process's on the same global batch, and
``Trainer`` with ``ActQCallback`` through ``accelerate launch --use_deepspeed`` (ZeRO-3) and
``TrainingArguments(deepspeed=...)`` (ZeRO-2).

DeepSpeed builds a small C++ op for its CPU collectives on the first launch (torch's extension
cache, ``~/.cache/torch_extensions``, keeps it for every later launch and run)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_actq
from hf_actq.testing import free_port

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).with_name("deepspeed_script.py")
_spec = importlib.util.spec_from_file_location("deepspeed_script", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

# The whole-model gradient cosine floors of the training-conditions matrix (fp32).
FLOORS = {"fewbit": 0.999, "uniform": 0.87, "alam": 0.08, "checkpoint": 0.955}
TRAINER_RECIPES = ("stock", "fewbit", "uniform", "alam", "alam-plan", "checkpoint")


def _environment():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("TRITON_INTERPRET", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    return env


def _run(command, out_dir: Path):
    proc = subprocess.run(
        command, env=_environment(), capture_output=True, text=True, timeout=600, cwd=out_dir
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out_dir / f"rank{i}.pt") for i in range(2)]


def _torchrun(out_dir: Path, *arguments):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(SCRIPT), str(out_dir), *arguments]
    return _run(command, out_dir)


def _plan_file(out_dir: Path) -> None:
    """A plan calibrated in one process, for "alam-plan" (ZeRO-3 cannot calibrate)."""
    model = script.tiny_llama()
    handle = hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("alam"))
    ids = script.CausalRows().ids[:4]
    handle.calibrate({"input_ids": ids, "labels": ids})
    handle.plan.save(out_dir / "plan.json")


def _cosine(a: dict, b: dict) -> float:
    flat_a = torch.cat([a[name].flatten() for name in a])
    flat_b = torch.cat([b[name].flatten() for name in a])
    return torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0).item()


# One launch per test: each runs many cases inside (a launch costs 10-20 s on two cores, and a
# module fixture would launch once per pytest-xdist worker).
def test_zero2_and_zero3_gradients_equal_one_process_with_exact_codecs_and_meet_the_floors(
    tmp_path,
):
    ranks = _torchrun(tmp_path, "engine")
    stock = script.single_process_gradients("stock", None, False)
    failures = []
    for stage in (2, 3):
        for recipe, checkpointing in script.CASES:
            name = script.case_name(recipe, checkpointing)
            where = f"ZeRO-{stage} {name}"
            exact = ranks[0][(stage, name, True)]
            # ZeRO-3 really sharded every parameter (the fused MLP's weights, the head).
            assert exact["sharded"] == (stage == 3), where
            for key in ((stage, name, True), (stage, name, False)):  # the ranks agree
                for param, grad in ranks[1][key]["grads"].items():
                    assert torch.equal(grad, ranks[0][key]["grads"][param]), (key, param)
            # Every codec exact: the same fused ops and recomputes, deterministic, so the
            # ranks' mean gradient is one process's on the whole batch (measured: within
            # 2.7e-7 relative).
            reference = script.single_process_gradients(recipe, checkpointing, True)
            for param, grad in exact["grads"].items():
                want = reference[param]
                error = ((grad - want).norm() / want.norm().clamp_min(1e-12)).item()
                if not error < 2e-6:
                    failures.append(f"{where} exact: {param} off by {error:.2e}")
            # The recipe's own codecs: stochastic rounding, each rank with its own draws.
            cosine = _cosine(ranks[0][(stage, name, False)]["grads"], stock)
            if not cosine > FLOORS[recipe]:
                failures.append(f"{where}: gradient cosine with stock {cosine:.4f}")
    assert not failures, failures


@pytest.mark.slow  # 20 s a launch
@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "qwen3_5_text"])
def test_zero2_and_zero3_gradients_of_moe_decoders_equal_one_process(tmp_path, model_type):
    # gpt-oss: eager attention with sinks (the module's own parameter, read in backward), the
    # experts op that recomputes the gate, fp32-scaled norms; DeepSeek-V3: latent attention and
    # the few-bit experts op; Qwen3.5: its delta-rule mixer run again in backward (its own
    # parameters and its projections' read there). Every parameter sharded under ZeRO-3 and
    # gathered again in backward.
    ranks = _torchrun(tmp_path, "engine", model_type)
    reference = script.single_process_gradients("uniform", None, True, model_type)
    for stage in (2, 3):
        exact = ranks[0][(stage, "uniform", True)]
        assert exact["sharded"] == (stage == 3)
        assert exact["grads"].keys() == reference.keys()
        for param, grad in exact["grads"].items():
            want = reference[param]
            error = ((grad - want).norm() / want.norm().clamp_min(1e-12)).item()
            assert error < 2e-6, (stage, param, error)


def _check_trainer_runs(ranks, stage: int, out_dir: Path) -> None:
    runs = ranks[0]
    stock = runs["stock"]
    # One process without DeepSpeed on one rank's micro-batch: the activation memory to log.
    recipes = ("fewbit", "uniform", "alam-plan")
    alone = script.train_recipes(str(out_dir / "alone"), None, recipes, str(out_dir / "plan.json"))
    for recipe, run in runs.items():
        if "error" in run:
            continue
        assert run["world"] == 2 and run["engine"] == "DeepSpeedEngine", recipe
        assert run["sharded"] == (stage == 3), recipe
        for param, weight in run["weights"].items():  # the replicas agree
            assert torch.equal(weight, ranks[1][recipe]["weights"][param]), (recipe, param)
        # The forward is exact: the first loss is stock's; later ones follow weights that differ
        # by rounding noise.
        assert run["losses"][0] == pytest.approx(stock["losses"][0], rel=1e-6), recipe
        assert run["losses"] == pytest.approx(stock["losses"], rel=2e-3), recipe
        # The logged activation memory counts activations only (ZeRO-3 used to count the
        # weights it gathers, and q, k, v and gate, up each packed their input: ZeRO-3 hands
        # each module an alias of it).
        if recipe in alone:
            assert run["memory"] == alone[recipe]["memory"], recipe
    # Reentrant checkpointing (Trainer's default) under "uniform": its recompute runs the fused
    # gated MLP, whose weights ZeRO-3 gathers with the MLP.
    assert runs["uniform"]["losses"]


def test_trainer_under_zero3_through_accelerate_launch(tmp_path):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("the accelerate launcher is not on PATH")
    _plan_file(tmp_path)
    (tmp_path / "ds3.json").write_text(json.dumps(script.zero_config(3)))
    command = [launcher, "launch", "--use_deepspeed", "--deepspeed_config_file", "ds3.json"]
    command += ["--num_processes", "2", "--num_machines", "1", "--dynamo_backend", "no"]
    command += ["--zero3_init_flag", "false", "--main_process_port", str(free_port())]
    command += [str(SCRIPT), str(tmp_path), "trainer", "launcher", *TRAINER_RECIPES]
    ranks = _run(command, tmp_path)
    _check_trainer_runs(ranks, 3, tmp_path)
    runs = ranks[0]
    # ALAM's calibration would go through ZeRO-3's gradient partitioning: one clear error on
    # every rank, before any step; with a plan it trains.
    assert runs["alam"]["engine"] is None
    assert "ActQConfig(plan=path)" in runs["alam"]["error"]
    assert ranks[1]["alam"]["error"] == runs["alam"]["error"]
    assert runs["alam-plan"]["plan"] is not None


@pytest.mark.slow  # 20 s a launch; the ZeRO-3 launch above stays in the default run
def test_trainer_under_zero2_through_the_deepspeed_argument_calibrates_alam(tmp_path):
    _plan_file(tmp_path)
    ranks = _torchrun(tmp_path, "trainer", "2", *TRAINER_RECIPES)
    _check_trainer_runs(ranks, 2, tmp_path)
    # Calibrated on each rank's examples with ZeRO's gradient hooks left alone, sensitivities
    # averaged: one plan on both ranks.
    assert ranks[0]["alam"]["plan"] is not None
    assert ranks[0]["alam"]["plan"] == ranks[1]["alam"]["plan"]
