"""Gradient cosine similarity per recipe and model type: the numbers behind the README's bounds.

    python benchmarks/bench_gradients.py [--output benchmarks/results/bench_gradients.json]

Uses the tiny models of the gradient-bound tests (``tests/integrations/test_apply.py``, every
registered model type) and the same measurement: one step's whole-model gradient under a recipe
against the exact one, stochastic-rounding seeds from ``torch.manual_seed(0)``. For "alam" at
1 bit it also averages 16 draws, to show whether the error averages out (it would if unbiased).
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


def measure(model_type: str, draws: int) -> dict:
    model = test_apply._model(model_type)
    batch = test_apply._batch(model_type)
    exact = _flat(test_apply._step(model, batch)[1])
    row = {}
    for name, overrides in RECIPES:
        handle = hf_actq.apply(model, ActQConfig.from_recipe(name, **overrides))
        torch.manual_seed(0)
        total = _flat(test_apply._step(model, batch)[1])
        label = name + (f":bits={overrides['bits']}" if overrides else "")
        row[label] = _cosine(exact, total)
        if name == "alam" and not overrides:
            for _ in range(draws - 1):
                total = total + _flat(test_apply._step(model, batch)[1])
            row[f"alam mean of {draws}"] = _cosine(exact, total)
        handle.revert()
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
    print("| model type | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for model_type, row in results.items():
        print(f"| {model_type} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    worst = {c: min(row[c] for row in results.values()) for c in columns}
    median = {c: sorted(row[c] for row in results.values())[len(results) // 2] for c in columns}
    print("| worst | " + " | ".join(f"{worst[c]:.3f}" for c in columns) + " |")
    print("| median | " + " | ".join(f"{median[c]:.3f}" for c in columns) + " |")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"cosines": results, "worst": worst, "median": median}, file, indent=1)


if __name__ == "__main__":
    main()
