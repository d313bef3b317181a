"""Gradient cosine similarity per recipe and model type: the numbers behind the bounds in
docs/reference.md ("Gradient error per recipe").

    python benchmarks/bench_gradients.py [--output benchmarks/results/bench_gradients.json]

Uses the tiny models of the gradient-bound tests (``tests/integrations/test_apply.py``, every
registered model type) and the same measurement (``_gradient_cosines``): one step's gradient
under a recipe against the exact one, stochastic-rounding seeds from ``torch.manual_seed(0)``;
the cosine of the whole model's gradient, and the smallest and the median of the per-tensor
cosines. For "alam" at 1 bit it also averages 16 draws, to show whether the error averages out
(it would if unbiased).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations"))
import test_apply  # noqa: E402

import hf_actq  # noqa: E402
from hf_actq import ActQConfig  # noqa: E402

RECIPES = [
    ("fewbit", {}),
    ("uniform", {"bits": 8}),
    ("uniform", {"bits": 4}),
    ("uniform", {}),
    ("alam", {"bits": 2}),
    ("alam", {}),
]


def _flat(grads):
    return torch.cat([g.flatten() for g in grads if g is not None])


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


STATISTICS = ("whole", "min tensor", "median tensor")


def measure(model_type: str, draws: int) -> dict:
    row = {}
    for name, overrides in RECIPES:
        label = name + (f":bits={overrides['bits']}" if overrides else "")
        config = ActQConfig.from_recipe(name, **overrides)
        whole, per_tensor = test_apply._gradient_cosines(model_type, config)
        per_tensor = sorted(per_tensor)
        row[label] = dict(zip(STATISTICS, (whole, per_tensor[0], per_tensor[len(per_tensor) // 2])))
    model = test_apply._model(model_type)
    batch = test_apply._batch(model_type)
    exact = _flat(test_apply._step(model, batch)[1])
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam"))
    torch.manual_seed(0)
    total = sum(_flat(test_apply._step(model, batch)[1]) for _ in range(draws))
    handle.revert()
    row[f"alam mean of {draws}"] = {"whole": _cosine(exact, total)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=16)
    parser.add_argument("--output")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # the generic-path warnings of the tiny models
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
