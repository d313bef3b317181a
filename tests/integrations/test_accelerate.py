"""Two processes under ``accelerate launch`` (CPU, gloo), DDP and FSDP2 (torch's
``fully_shard``: accelerate itself falls back to DDP on CPU), compared with one process
training on the same global batches, patched and unpatched; and the two ranks draw different
rounding noise, so averaging their gradients reduces it."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import hf_actq
from hf_actq.testing import free_port

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("accelerate_script.py")
_spec = importlib.util.spec_from_file_location("accelerate_script", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def _launch(tmp_path, *arguments, script_path=SCRIPT):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("the accelerate launcher is not on PATH")
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    command = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    command += ["--main_process_port", str(free_port())]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    command += [str(script_path), str(tmp_path), *arguments]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]


def _single_process(recipe: str | None):
    model = script.build_model()
    if recipe is not None:
        hf_actq.apply(model, script.CONFIGS[recipe])
    initial = script.full_weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = script.train(model, optimizer, rank=0, world=1)
    return losses, initial, script.full_weights(model)


def _update_cosine(initial, a, b):
    delta_a = torch.cat([(a[n] - initial[n]).flatten() for n in initial])
    delta_b = torch.cat([(b[n] - initial[n]).flatten() for n in initial])
    return torch.nn.functional.cosine_similarity(delta_a, delta_b, dim=0).item()


@pytest.fixture(scope="module")
def references():
    return {recipe: _single_process(recipe) for recipe in (None, "uniform", "checkpoint")}


@pytest.mark.parametrize(
    ("mode", "when", "recipe"),
    [
        # 11-18 s each on two cores: the default run keeps DDP; -m slow runs all five.
        ("ddp", "before", "uniform"),
        pytest.param("fsdp2", "before", "uniform", marks=pytest.mark.slow),
        pytest.param("fsdp2", "after", "uniform", marks=pytest.mark.slow),
        pytest.param("ddp", "before", "checkpoint", marks=pytest.mark.slow),
        pytest.param("fsdp2", "before", "checkpoint", marks=pytest.mark.slow),
    ],
)
def test_two_processes_match_one_process_on_the_same_global_batch(
    tmp_path, references, mode, when, recipe
):
    ranks = _launch(tmp_path, mode, when, recipe)
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["sharded"] == (mode == "fsdp2") for r in ranks)  # FSDP2 really ran
    assert ranks[0]["patched"] == ranks[1]["patched"] and ranks[0]["patched"]
    norms = sum(d.startswith("norm") for d in ranks[0]["patched"].values())
    if recipe == "checkpoint":  # the layers run stock inside; the final norm is compressed
        assert norms == 1 and ranks[0]["checkpointed"] == ["model.layers.0", "model.layers.1"]
    else:
        assert norms == 5
    for name, weight in ranks[0]["weights"].items():  # the replicas agree
        assert torch.equal(weight, ranks[1]["weights"][name]), name
    # Each rank rounds with its own seeds: averaging the two gradients averages the noise.
    assert not torch.equal(ranks[0]["codes"], ranks[1]["codes"])
    # Calibrated on different examples, with the sensitivities averaged: one plan.
    assert ranks[0]["plan"] == ranks[1]["plan"]

    losses, initial, weights = references[recipe]
    unpatched_losses, _, unpatched_weights = references[None]
    global_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    # The forward is exact: the first step's loss is the single process's to rounding; later
    # steps follow weights that differ only by rounding noise.
    assert global_losses[0] == pytest.approx(losses[0], rel=1e-6)
    assert global_losses == pytest.approx(losses, rel=2e-3)
    assert global_losses == pytest.approx(unpatched_losses, rel=2e-3)
    # Measured 0.992-0.994 for all three (uniform 4-bit, 3 SGD steps).
    assert _update_cosine(initial, ranks[0]["weights"], weights) > 0.985
    assert _update_cosine(initial, ranks[0]["weights"], unpatched_weights) > 0.985


def test_trainer_under_ddp_trains_the_checkpoint_recipe_without_find_unused_settings(tmp_path):
    # Trainer picks find_unused_parameters=True before the callback turns checkpointing on;
    # the packed checkpoint's node then lists the layers' parameters as its inputs, so DDP sees
    # them used and each gets its gradient once.
    ranks = _launch(tmp_path, "trainer", "stock", "checkpoint-4")
    stock, run = ranks[0]["stock"], ranks[0]["checkpoint-4"]
    assert run["world"] == 2 and run["wrapper"] == "DistributedDataParallel"
    for name, weight in run["weights"].items():  # the replicas agree
        assert torch.equal(weight, ranks[1]["checkpoint-4"]["weights"][name]), name
    assert run["losses"][0] == pytest.approx(stock["losses"][0], rel=1e-6)
    assert run["losses"] == pytest.approx(stock["losses"], rel=2e-3)


@pytest.mark.slow  # 14 s; tests/integrations/test_apply.py shares norm outputs in one process
@pytest.mark.slow  # 15 s a launch
@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "qwen3_5_text"])
def test_fsdp2_decoders_give_the_unsharded_gradients(tmp_path, model_type):
    # gpt-oss's attention sinks (read in backward through the module), its recomputed-gate
    # experts, DeepSeek-V3's few-bit experts and Qwen3.5's linear-attention mixers (their
    # forward run again in backward) take FSDP2's unsharded parameters: with exact codecs the
    # sharded step is the unsharded copy's.
    ranks = _launch(tmp_path, model_type, script_path=SCRIPT.with_name("fsdp_bert_script.py"))
    for record in ranks:
        assert record["sharded"]
        # Every mixer ran again in backward (the tiny Qwen3.5 has one; the others none).
        assert record["recomputes"] == record["mixers"] == (model_type == "qwen3_5_text")
        loss, reference_loss = record["losses"]
        assert loss == pytest.approx(reference_loss, rel=1e-6)
        assert record["grads"].keys() == record["reference"].keys()
        for name, grad in record["grads"].items():
            want = record["reference"][name]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7, msg=name)


def test_fsdp2_bert_shares_norm_outputs_across_units(tmp_path):
    # Each BERT layer's last LayerNorm feeds the next layer's q, k, v (another FSDP unit), whose
    # backward rebuilds its input from the norm's packed x_hat and weight: the sharded run's loss
    # is the unsharded copy's and its gradients agree with them.
    ranks = _launch(tmp_path, script_path=SCRIPT.with_name("fsdp_bert_script.py"))
    for record in ranks:
        assert record["sharded"] and record["norms"] == 5
        loss, reference_loss = record["losses"]
        assert loss == pytest.approx(reference_loss, rel=1e-6)
        # The two runs round with different draws: the gradients agree as 8-bit noise allows.
        for name, grad in record["grads"].items():
            want = record["reference"][name]
            if want.norm() > 1e-6:  # not the (zero) key-bias gradients
                cosine = torch.nn.functional.cosine_similarity(grad.flatten(), want.flatten(), 0)
                assert cosine > 0.999, name
