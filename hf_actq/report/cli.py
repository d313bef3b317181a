"""``hf-actq memory`` / ``python -m hf_actq memory``: how much memory hf_actq saves on a model.

With no arguments it measures the embedded default, RoBERTa-base's shapes (random weights, no
downloads) at batch 8 and sequence 128 in fp32, under the baseline, transformers' own gradient
checkpointing ("stock-checkpointing") and the "fewbit", "uniform", "alam" and "checkpoint"
recipes, and prints the table.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

DEFAULT_RECIPES = ["stock-checkpointing", "fewbit", "uniform", "alam", "checkpoint"]
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def parse_size(text: str) -> int:
    """ "80GiB", "80GB", "24G", "512MiB" -> bytes (GB and G are taken as GiB, as GPUs are sold)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size like 80GiB or 24GB, got {text!r}")
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * 1024**power)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def slot_count(text: str) -> int | None:
    """A positive integer, or 'all' (None)."""
    return None if text == "all" else positive_int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported in one line (and no usage block above it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def device_name(text: str) -> str:
    """cpu, cuda or cuda:N: where a training step's memory can be measured."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from hf_actq.report.presets import PRESETS

    parser = Parser(
        prog="hf-actq memory",
        description="Measure activation and peak memory of one training step per recipe.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default="roberta-base",
        help=f"a preset ({', '.join(PRESETS)}), a local model directory, or a hub id "
        "(needs network; only its config is used). Default: roberta-base",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the preset's dtype")
    parser.add_argument("--peft", choices=("none", "lora", "qlora"), default="none")
    parser.add_argument(
        "--recipe",
        nargs="+",
        default=DEFAULT_RECIPES,
        help='recipes compared with the baseline, with optional overrides: "fewbit:bits=2" '
        f'"uniform:bits=4" "alam:bits=0.5". Default: {" ".join(DEFAULT_RECIPES)}. For a causal '
        'or seq2seq LM the report adds "chunked-loss" (the stock model but for the chunked linear + '
        'cross-entropy) when a recipe uses it. "stock-checkpointing" is the unpatched model under '
        "transformers' own gradient checkpointing.",
    )
    parser.add_argument(
        "--gpu-memory",
        type=parse_size,
        default=parse_size("80GiB"),
        help="GPU memory for the max-batch column, e.g. 24GB or 80GiB (default 80GiB)",
    )
    parser.add_argument(
        "--layers",
        choices=("auto", "all", "scaled"),
        default="auto",
        help="all: build every layer; scaled: measure 1 and 2 layers (a hybrid's repeating run "
        "of layer kinds once and twice) and extrapolate (the peak: each phase's on its own, the "
        "largest taken); "
        "auto: all when it fits comfortably in memory",
    )
    parser.add_argument(
        "--calibration-examples",
        type=positive_int,
        default=2,
        help="examples of the batch an adaptive recipe (alam) calibrates its bit plan on, at "
        "most the recipe's own calibration_examples (default 2: the weights are random, and "
        "each measured slot costs a backward; ALAM's own sensitivity takes 1)",
    )
    parser.add_argument(
        "--calibration-slots",
        type=slot_count,
        default=4,
        help="saved tensors an adaptive recipe's calibration measures at most, every kind in "
        "turn and spread over depth (default 4: one of each common kind, for a memory figure "
        "that hardly depends on which; 'all': every one). The others take the median "
        "sensitivity of their kind, and the report says how many were measured. A count gives "
        "the same plan on any machine",
    )
    parser.add_argument(
        "--calibration-seconds",
        type=positive_seconds,
        default=math.inf,
        help="time cap of an adaptive recipe's calibration (default: none). A cap makes the "
        "plan depend on the machine's speed",
    )
    parser.add_argument("--task", choices=("causal-lm", "classification", "seq2seq-lm"))
    parser.add_argument("--attn-implementation", help="e.g. eager or sdpa (default: the model's)")
    parser.add_argument(
        "--device", type=device_name, help="cpu, cuda or cuda:N (default: cuda when available)"
    )
    parser.add_argument("--output", help="directory for memory.json, memory.md and memory.png")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def load_config(model: str):
    from transformers import AutoConfig

    from hf_actq.report.presets import PRESETS, preset_config

    if model in PRESETS:
        return preset_config(model), PRESETS[model]
    try:
        return AutoConfig.from_pretrained(model), None
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"hf-actq memory: {model!r} is not a preset ({', '.join(PRESETS)}) and its config "
            f"could not be loaded as a local directory or hub id: {error}"
        ) from None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output:
        # Before any work: the report is written after minutes of measuring.
        try:
            os.makedirs(args.output, exist_ok=True)
        except OSError as error:
            parser.error(f"--output {args.output!r} cannot be a directory for the report: {error}")
    import torch

    from hf_actq.report import (
        CHUNKED_LOSS,
        STOCK_CHECKPOINTING,
        default_task,
        measure_model,
        parse_recipe,
    )

    config, preset = load_config(args.model)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    if dtype is None:
        dtype = preset.dtype if preset else getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device} was given but no CUDA device is available")
    bar = None
    progress = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="hf-actq memory", unit="step", file=sys.stderr, leave=False)
        steps_started = []

        def progress(what: str, total: int) -> None:
            # Called as each step starts: the previous one is done.
            bar.total = total
            bar.update(1 if steps_started else 0)
            steps_started.append(what)
            bar.set_postfix_str(what)

    # The code measured is the code loaded now: a commit made while a long run goes on (or
    # uncommitted changes) must not be recorded as what made its numbers.
    from hf_actq.report.provenance import provenance

    started = provenance(argv) if args.output else None
    recipes = list(args.recipe)
    task = args.task or (preset.task if preset else None) or default_task(config)
    try:
        configs = [parse_recipe(spec)[1] for spec in recipes]
        fused = any(getattr(c, "fused_loss", False) for c in configs)
        if task in ("causal-lm", "seq2seq-lm") and fused and CHUNKED_LOSS not in recipes:
            # The stock model with only the chunked loss, so each part's gain is visible.
            recipes.insert(0, CHUNKED_LOSS)
        report = measure_model(
            config,
            recipes,
            name=args.model,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            dtype=dtype,
            peft=args.peft,
            task=task,
            layers=args.layers,
            gpu_memory_bytes=args.gpu_memory,
            device=device,
            attn_implementation=args.attn_implementation,
            calibration_examples=args.calibration_examples,
            calibration_slots=args.calibration_slots,
            calibration_seconds=args.calibration_seconds,
            progress=progress,
        )
    except ValueError as error:
        raise SystemExit(f"hf-actq memory: {error}") from None
    finally:
        if bar is not None:
            bar.close()
    print(report.to_markdown())
    walked = [row for row in report.rows() if row["recipe"] != STOCK_CHECKPOINTING]
    worst = max(
        abs(row["activation_bytes"] - row["independent_count_bytes"])
        / max(row["activation_bytes"], 1)
        for row in walked
    )
    print(
        f"independent count (autograd graph walk) agrees within {100 * worst:.2f}%"
        + (" (stock checkpointing not walked: the walk would recompute its layers)"
           if len(walked) < len(report.rows()) else "")
    )  # fmt: skip
    if args.output:
        report.provenance = started
        for path in report.write(args.output):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
