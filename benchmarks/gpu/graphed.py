"""The CUDA-graphed step: MiniLM's shapes (fp32, batch 32, seq 128) under
``torch.compile(mode="reduce-overhead")``, the unpatched model and each recipe compiled alike and
timed in one run (issue 69: the graphed patched step within 1.3x of the graphed unpatched one).

    python benchmarks/gpu/graphed.py --out DIR [--dry-run]

Per recipe: the median step time over ``--steps`` steps after three warm-up steps (compile,
record, first replay), its ratio to the unpatched compiled step's, the compile seconds, and the
CUDA graphs inductor skipped with its reasons (``cudagraph_skips``: a skipped graph runs
without replay, so its ratio measures no graph). Forward and backward are compiled; AdamW runs
eagerly on both sides. ``--dry-run``: the CPU, tiny shapes, the aot_eager backend (checks the
script, times nothing that matters).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import check  # noqa: E402

RECIPES = {"baseline": None, "fewbit": ("fewbit", {}), "uniform": ("uniform", {"bits": 4})}


def run(device: torch.device, dry: bool, steps: int) -> list[dict]:
    from torch._dynamo.utils import counters

    import hf_actq
    from hf_actq import ActQConfig

    models = check.step_models(device, dry)
    minilm = next(build for name, build, _ in models if name.startswith("MiniLM shapes, fp32"))
    base_model, batch = minilm()
    rows = []
    for recipe, spec in RECIPES.items():
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base_model).train()
        if spec is not None:
            hf_actq.apply(model, ActQConfig.from_recipe(spec[0], **spec[1]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        compiled = torch.compile(
            model, **({"backend": "aot_eager"} if dry else {"mode": "reduce-overhead"})
        )

        def step(compiled=compiled, optimizer=optimizer):
            compiled(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        began = time.perf_counter()
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - began
        times = [check._timed(step, device, 1) for _ in range(1 if dry else steps)]
        skips = dict(counters["inductor"])
        rows.append(
            {
                "recipe": recipe,
                "step ms": statistics.median(times) * 1e3,
                "compile s": compile_s,
                "cudagraph skips": skips.get("cudagraph_skips", 0),
                "inductor counters": skips,
            }
        )
        print(rows[-1], flush=True)
        del model, compiled, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["step ms"]
    for row in rows:
        row["time ratio"] = row["step ms"] / base
    return rows


def markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"# CUDA-graphed MiniLM step ({device})",
        "",
        "| recipe | step ms | ratio to the graphed unpatched step | compile s | graphs skipped |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['recipe']} | {row['step ms']:.2f} | {row['time ratio']:.2f}x | "
            f"{row['compile s']:.0f} | {row['cudagraph skips']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gpu"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, aot_eager")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    rows = run(device, args.dry_run, args.steps)
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graphed.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    (out / "graphed.md").write_text(markdown(rows, name))
    print(markdown(rows, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
