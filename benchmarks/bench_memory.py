"""Activation memory and max batch, side by side with the published numbers.

    python benchmarks/bench_memory.py --only fewbit --output benchmarks/results/bench_memory.json
    python benchmarks/bench_memory.py --only alam --output benchmarks/results/bench_memory_alam.json

Each part has its own results file, so that each file's provenance names the commit its figures
were measured at (part 2 runs bf16 GEMMs for hours on a CPU without bf16 instructions).

Part 1, few-bit paper App. B (ICML 2023): RoBERTa-base, RoBERTa-large and GPT-2, fp32, full
fine-tuning, sequence 256, eager attention (as in the paper's transformers version); activation
size per sample, the part kept by the nonlinearities, and the largest batch on a 32 GiB GPU with
four model copies (weights, gradients, two Adam moments) at 1..4 bits. Also the issue's goals:
3-bit few-bit alone saves >= 15% of activation memory on RoBERTa-base, and with 1-bit dropout
masks >= 25%.

Part 2, ALAM (ICLR 2024) Tables 3 and 5: LLaMA2-7B shapes, LoRA (r 8 on q/v), bf16, micro-batch 8,
sequence 512. Baseline, "uniform" 4-bit (GACT's setting), "alam" spread evenly at 3, 2, 1 and 0.5
bits average, and "alam" at 1 bit with its adaptive plan (as ALAM publishes it).
Micro-batch 8 is measured (1 and 2 layers, extrapolated to 32); micro-batches 32 and 64 are
extrapolated linearly in the batch from measured micro-batches 1 and 2, after checking that this
line predicts the measured micro-batch 8.

Part 3 (`--only llama`), ALAM Tables 3 and 4 for the LoRA/QLoRA recipe: LLaMA2-7B and LLaMA2-13B
shapes, each with LoRA in bf16 and with QLoRA (bitsandbytes nf4 base, bf16 compute), sequence
512, micro-batches 8, 1 and 2 measured (32 and 64 extrapolated from 1 and 2): baseline,
"uniform" 4 bits, and "alam" at 1 bit with its adaptive plan and spread evenly; activation
memory and total (model state + activations). Resumable: a configuration already in --output is
not measured again.

Every figure is the bytes autograd holds (hf_actq.memory, checked against a walk of the autograd
graph), not nominal bits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from provenance import write_json

from hf_actq.report import measure_model
from hf_actq.report.presets import preset_config

MB = 2**20
GIB = 2**30

# ICML 2023 App. B: model MB, all activations MB/sample, nonlinearity MB/sample, max batch
# (standard, 1, 2, 3, 4 bits); arxiv Table 4: saving % at 1..4 bits.
FEWBIT_PAPER = {
    "roberta-base": (480.7, 185.6, 36.0, [166, 204, 203, 201, 200], [16, 15, 15, 14]),
    "roberta-large": (1355.6, 482.1, 96.0, [56, 70, 69, 69, 68], [16, 16, 15, 15]),
    "gpt2": (491.0, 297.1, 146.2, [103, 198, 192, 187, 182], [42, 41, 39, 38]),
}
# ALAM Table 3 (micro-batch 8) and Table 5 (activation / total GB at micro-batch 8, 32, 64).
ALAM_PAPER = {
    "baseline": {"act8": 21.1, "t5": [(21, 34), (84, 98), (169, 182)]},
    "uniform:bits=4": {"act8": 5.9, "label": "GACT 4-bit", "t5": [(6, 19), (24, 37), (47, 60)]},
    "alam:bits=3,adaptive=False": {"act8": 4.8, "label": "alam 3-bit, even"},
    "alam:bits=2,adaptive=False": {"act8": 3.4, "label": "alam 2-bit, even"},
    "alam:bits=1,adaptive=False": {"act8": 2.0, "label": "alam 1-bit, even"},
    "alam:bits=0.5,adaptive=False": {"label": "alam 0.5-bit, even"},
    # ALAM as published: the adaptive plan (calibrated on 2 examples of the random batch).
    "alam:bits=1": {
        "act8": 2.0,
        "label": "alam 1-bit, adaptive",
        "t5": [(2, 15), (8, 21), (16, 29)],
    },
}


def fewbit_part(batch_size: int = 2, seq_len: int = 256) -> dict:
    recipes = [f"fewbit:bits={b}" for b in (1, 2, 3, 4)]
    recipes.append("fewbit:bits=3,dropout=true,dropout_mode=mask")
    out = {}
    for name in FEWBIT_PAPER:
        start = time.time()
        report = measure_model(
            preset_config(name),
            recipes,
            name=name,
            batch_size=batch_size,
            seq_len=seq_len,
            layers="scaled",
            gpu_memory_bytes=32 * GIB,
            attn_implementation="eager",
            task="classification" if name.startswith("roberta") else "causal-lm",
        )
        out[name] = {"report": report.to_dict(), "seconds": time.time() - start}
        print(report.to_markdown())
    return out


def goals_part(batch_size: int = 2) -> dict:
    """RoBERTa-base, fp32: the share few-bit 3-bit saves alone and with 1-bit dropout masks, at
    the paper's sequence 256 and at 128 (attention's seq^2 tensors weigh less there)."""
    out = {}
    for seq_len in (128, 256):
        report = measure_model(
            preset_config("roberta-base"),
            ["fewbit:bits=3", "fewbit:bits=3,dropout=true,dropout_mode=mask"],
            name="roberta-base",
            batch_size=batch_size,
            seq_len=seq_len,
            layers="scaled",
            task="classification",
        )
        out[f"seq{seq_len}"] = report.to_dict()
    return out


def print_goals(out: dict) -> None:
    print("\nGoals, RoBERTa-base fp32 (default attention), activation memory saved:\n")
    print(
        "| sequence | baseline MiB/sample | few-bit 3-bit (goal >= 15%) | + 1-bit dropout masks (goal >= 25%) |"
    )
    print("|---:|---:|---:|---:|")
    for data in out.values():
        rows = data["rows"]
        print(
            f"| {data['seq_len']} | {rows[0]['activation_bytes'] / data['batch_size'] / MB:.1f} | "
            f"{100 * rows[1]['activation_saved']:.2f}% | {100 * rows[2]['activation_saved']:.2f}% |"
        )


def print_fewbit(out: dict) -> None:
    print("\nFew-bit App. B, per sample (fp32, seq 256, eager attention), ours vs paper:\n")
    print(
        "| model | model MiB | all act. MiB/sample | nonlin. MiB/sample | max batch 32 GiB: "
        "standard / 1 / 2 / 3 / 4 bits | saving 1 / 2 / 3 / 4 bits | 3-bit + 1-bit dropout masks |"
    )
    print("|---|---:|---:|---:|---|---|---:|")
    for name, (p_model, p_act, p_nonlin, p_batch, p_saving) in FEWBIT_PAPER.items():
        data = out[name]["report"]
        rows = data["rows"]
        batch = data["batch_size"]
        base = rows[0]
        nonlin = base["by_kind"].get("activation", 0) / batch
        model_mib = data["results"][0]["measurement"]["param_bytes"] / MB
        batches = " / ".join(str(r["max_batch_size"]) for r in rows[:5])
        savings = " / ".join(f"{100 * r['activation_saved']:.0f}%" for r in rows[1:5])
        print(
            f"| {name} ours | {model_mib:.1f} | {base['activation_bytes'] / batch / MB:.1f} | "
            f"{nonlin / MB:.1f} | {batches} | {savings} | "
            f"{100 * rows[5]['activation_saved']:.1f}% |"
        )
        print(
            f"| {name} paper | {p_model} | {p_act} | {p_nonlin} | "
            f"{' / '.join(map(str, p_batch))} | {' / '.join(f'{s}%' for s in p_saving)} | - |"
        )


def alam_part() -> dict:
    recipes = [r for r in ALAM_PAPER if r != "baseline"]
    kwargs = dict(seq_len=512, dtype=torch.bfloat16, peft="lora", layers="scaled")
    config = preset_config("llama2-7b")
    out = {}
    for batch in (8, 1, 2):
        start = time.time()
        report = measure_model(
            config, recipes, name="llama2-7b", batch_size=batch, gpu_memory_bytes=48 * GIB, **kwargs
        )
        out[f"mb{batch}"] = {"report": report.to_dict(), "seconds": time.time() - start}
        if batch == 8:
            print(report.to_markdown())
    return out


# ALAM Table 3 (activation GB; LLaMA2-13B at micro-batch 2) and Table 4 (model state and
# activation GB at micro-batch 8), by model and PEFT mode.
ALAM_LLM_PAPER = {
    ("llama2-7b", "lora"): {
        "state": 13,
        8: {"baseline": 21.1, "uniform:bits=4": 5.9, "alam:bits=1": 2.0},
    },
    ("llama2-13b", "qlora"): {
        "state": 7,
        2: {"baseline": 8.2, "alam:bits=1": 0.8},
        8: {"baseline": 33, "alam:bits=1": 3},
    },
}
# Micro-batch 8 everywhere; 1 and 2 where a table needs more (Table 5's extrapolation to 32 and
# 64 for 7B LoRA; Table 3's micro-batch 2 for 13B QLoRA).
LLM_BATCHES = {
    ("llama2-7b", "lora"): (8, 1, 2),
    ("llama2-7b", "qlora"): (8,),
    ("llama2-13b", "lora"): (8,),
    ("llama2-13b", "qlora"): (8, 2),
}
LLM_RECIPES = ["uniform:bits=4", "alam:bits=1", "alam:bits=1,adaptive=False"]
LLM_LABELS = {
    "baseline": "baseline (bf16)",
    "uniform:bits=4": '"uniform" 4-bit',
    "alam:bits=1": '"alam" 1-bit, adaptive',
    "alam:bits=1,adaptive=False": '"alam" 1-bit, even',
}


def llama_part(done: dict):
    """Yields the results so far after each newly measured configuration."""
    out = dict(done)
    for name in ("llama2-7b", "llama2-13b"):
        config = preset_config(name)
        for peft in ("lora", "qlora"):
            for batch in LLM_BATCHES[(name, peft)]:
                key = f"{name}/{peft}/mb{batch}"
                if key in out:
                    continue
                start = time.time()
                report = measure_model(
                    config, LLM_RECIPES, name=name, batch_size=batch, seq_len=512,
                    dtype=torch.bfloat16, peft=peft, layers="scaled", gpu_memory_bytes=48 * GIB,
                )  # fmt: skip
                out[key] = {"report": report.to_dict(), "seconds": time.time() - start}
                print(f"{key}: {time.time() - start:.0f} s", flush=True)
                yield out
    yield out


def print_llama(out: dict) -> None:
    for name in ("llama2-7b", "llama2-13b"):
        for peft in ("lora", "qlora"):
            rows = {b: out[f"{name}/{peft}/mb{b}"]["report"]["rows"] for b in (8, 1, 2)
                    if f"{name}/{peft}/mb{b}" in out}  # fmt: skip
            if 8 not in rows:
                continue
            paper = ALAM_LLM_PAPER.get((name, peft), {})
            print(
                f"\n**{name}, {'LoRA' if peft == 'lora' else 'QLoRA'}** (r 8 on q/v, bf16 compute, "
                f"sequence 512): activation / total GiB; model state "
                f"{rows[8][0]['model_state_bytes'] / GIB:.1f} GiB"
                + (f" (ALAM: {paper['state']} GB)" if paper else "")
                + "\n"
            )
            print(
                "| recipe | mb 8 | compression | mb 2 | mb 32 (extrap.) | mb 64 (extrap.) "
                "| ALAM, activation GB |"
            )
            print("|---|---|---:|---|---|---|---|")
            for index, row in enumerate(rows[8]):
                state = row["model_state_bytes"]

                def cell(act, state=state):
                    return f"{act / GIB:.2f} / {(act + state) / GIB:.1f}"

                two = cell(rows[2][index]["activation_bytes"]) if 2 in rows else "-"
                far = ["-", "-"]
                if 1 in rows and 2 in rows:
                    one, pair = (
                        rows[1][index]["activation_bytes"],
                        rows[2][index]["activation_bytes"],
                    )
                    far = [cell(2 * one - pair + mb * (pair - one)) for mb in (32, 64)]
                cited = "; ".join(
                    f"mb {mb}: {paper[mb][row['recipe']]}"
                    for mb in (8, 2)
                    if mb in paper and row["recipe"] in paper[mb]
                )
                print(
                    f"| {LLM_LABELS[row['recipe']]} | {cell(row['activation_bytes'])} | "
                    f"{row['compression']:.1f}x | {two} | {far[0]} | {far[1]} | {cited or '-'} |"
                )


def print_alam(out: dict) -> None:
    measured = {mb: out[f"mb{mb}"]["report"]["rows"] for mb in (1, 2, 8)}
    states = [r["model_state_bytes"] for r in measured[8]]
    print("\nALAM Table 3, LLaMA2-7B LoRA, bf16, micro-batch 8, seq 512 (measured):\n")
    print("| recipe | activation memory | compression | paper (GB, compression) |")
    print("|---|---:|---:|---|")
    paper_base = ALAM_PAPER["baseline"]["act8"]
    for row in measured[8]:
        paper = ALAM_PAPER[row["recipe"]]
        label = paper.get("label", row["recipe"])
        cited = (
            f"{paper['act8']} GB ({paper_base / paper['act8']:.1f}x)" if "act8" in paper else "-"
        )
        print(
            f"| {label} | {row['activation_bytes'] / GIB:.2f} GiB | {row['compression']:.1f}x | "
            f"{cited} |"
        )
    print("\nALAM Table 5, activation / total (model state + activations), GiB:\n")
    print(
        "| recipe | mb 8 (measured) | mb 32 (extrapolated) | mb 64 (extrapolated) | paper mb 8 / 32 / 64 |"
    )
    print("|---|---|---|---|---|")
    for index, row in enumerate(measured[8]):
        one, two = measured[1][index]["activation_bytes"], measured[2][index]["activation_bytes"]
        per_sample, fixed = two - one, 2 * one - two
        predicted8 = fixed + 8 * per_sample
        error8 = abs(predicted8 - row["activation_bytes"]) / row["activation_bytes"]
        cells = []
        for mb in (8, 32, 64):
            act = row["activation_bytes"] if mb == 8 else fixed + mb * per_sample
            cells.append(f"{act / GIB:.1f} / {(act + states[index]) / GIB:.1f}")
        paper = ALAM_PAPER[row["recipe"]].get("t5")
        cited = " ; ".join(f"{a} / {t}" for a, t in paper) if paper else "-"
        label = ALAM_PAPER[row["recipe"]].get("label", row["recipe"])
        print(f"| {label} | {' | '.join(cells)} | {cited} |")
        row["line_error_at_mb8"] = error8
    worst = max(r["line_error_at_mb8"] for r in measured[8])
    print(f"\nthe batch line from mb 1 and 2 predicts the measured mb 8 within {100 * worst:.3f}%")
    print(
        "max micro-batch on a 24 GiB RTX 3090 Ti (App. B method, model state + activations): "
        + ", ".join(
            f"{ALAM_PAPER[r['recipe']].get('label', r['recipe'])} "
            f"{math.floor((24 * GIB - states[i]) / (r['activation_bytes'] / 8))}"
            for i, r in enumerate(measured[8])
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("fewbit", "alam", "llama"))
    parser.add_argument("--output", default=None, help="JSON file for the raw reports")
    args = parser.parse_args()
    results = {}
    if args.only in (None, "fewbit"):
        results["fewbit"] = fewbit_part()
        results["goals"] = goals_part()
        print_fewbit(results["fewbit"])
        print_goals(results["goals"])
    if args.only in (None, "alam"):
        results["alam"] = alam_part()
        print_alam(results["alam"])
    if args.only == "llama":  # long: saved after every configuration, resumable
        previous = {}
        if args.output and os.path.exists(args.output):
            with open(args.output) as file:
                previous = json.load(file).get("llama", {})
        for partial in llama_part(previous):
            results["llama"] = partial
            _save(args.output, results)
        results["llama"] = results.get("llama", previous)
        print_llama(results["llama"])
    _save(args.output, results)


def _save(output: str | None, results: dict) -> None:
    if output:
        if os.path.exists(output):
            with open(output) as file:
                results = {**json.load(file), **results}
        write_json(output, results)


if __name__ == "__main__":
    main()
