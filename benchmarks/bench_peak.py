"""Step peak memory against sequence length: the unpatched model (stock SDPA) and each recipe,
side by side in one run, through the memory report's own measurement (``hf_actq.memory``: the
CPU allocator's events under the profiler, ``torch.cuda.max_memory_allocated`` on a GPU).

    python benchmarks/bench_peak.py --output benchmarks/results/bench_peak.json

Models: BERT-base's layer shapes and a LLaMA-style decoder (hidden 1024, 16 heads, 4 KV heads,
intermediate 2816), 2 layers each, batch 1, fp32 (``--dtype bfloat16``: weights and activations
in bf16, as GPU training runs), with a small vocabulary (2,048) so that the
layers, not the output head, decide the peak (the head is the chunked-loss issue's). The peak
column is the step's own: the most bytes live at once during forward, backward and the AdamW
step above the weights and optimizer state live when it began (activations, gradients and
temporaries).
"""

from __future__ import annotations

import argparse

import torch
from provenance import write_json

from hf_actq.report import measure_model
from hf_actq.report.presets import preset_config

MODELS = {
    "bert-base": lambda: preset_config("bert-base"),
    "llama-style": lambda: preset_config("tiny-llama").__class__(
        **{
            **preset_config("tiny-llama").to_dict(),
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
        }
    ),
}
RECIPES = ["fewbit", "uniform:bits=4", "alam:bits=1,adaptive=False"]


def measure(
    model: str, seq_len: int, recipes: list[str], device: str, dtype: torch.dtype
) -> list[dict]:
    config = MODELS[model]()
    config.num_hidden_layers, config.vocab_size = 2, 2048
    config.max_position_embeddings = max(seq_len, getattr(config, "max_position_embeddings", 0))
    report = measure_model(
        config,
        recipes,
        name=model,
        batch_size=1,
        seq_len=seq_len,
        layers="all",
        device=device,
        dtype=dtype,
    )
    rows = []
    for row, result in zip(report.rows(), report.results):
        m = result.measurement
        rows.append(
            {
                "model": model,
                "seq_len": seq_len,
                "recipe": row["recipe"],
                "activation_bytes": row["activation_bytes"],
                "peak_bytes": row["peak_bytes"],
                # Weights and AdamW moments are live before the step; gradients are not.
                "step_peak_bytes": row["peak_bytes"] - m.param_bytes - m.optimizer_bytes,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | seq | recipe | activation MiB | step peak above weights and optimizer state, MiB | vs baseline |",
        "|---|---:|---|---:|---:|---:|",
    ]
    base = {}
    for r in rows:
        key = (r["model"], r["seq_len"])
        if r["recipe"] == "baseline":
            base[key] = r["step_peak_bytes"]
        ratio = r["step_peak_bytes"] / base[key]
        flag = " **above**" if ratio > 1.001 else ""
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['recipe']} | {r['activation_bytes'] / 2**20:.1f} "
            f"| {r['step_peak_bytes'] / 2**20:.1f} | {ratio:.3f}x{flag} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512, 1024, 2048])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for model in args.models:
        for seq_len in args.seq_lens:
            rows += measure(model, seq_len, args.recipes, args.device, dtype)
            print(table(rows[-len(args.recipes) - 1 :]).split("\n", 2)[2], flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    if args.output:
        write_json(args.output, {"device": device, "dtype": args.dtype, "rows": rows})
    print(f"\ndevice: {device}, {args.dtype}\n" + table(rows))


if __name__ == "__main__":
    main()
