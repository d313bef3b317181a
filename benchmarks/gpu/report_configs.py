"""Writes the config folders that memory reports name in place of a preset, so that a lent
device (which gets no folder but the working tree) can re-run them: ``gemma3-1b-v32k``, Gemma 3
1B's shapes with a 32,768-token vocabulary (docs/memory.md, "Gemma"), ``gemma3-2l``, its
first two layers (``benchmarks/results/memory_gemma3_2l``), and ``qwen3_5-text-defaults``,
transformers' own Qwen3.5 text config (hidden 4096, 32 layers, three gated delta-rule layers in
four, a 248,320-token vocabulary: the defaults, not a released checkpoint's shapes), and
``gemma4-text-defaults``, Gemma 4's (hidden 2304, 30 layers, five sliding layers to a full one
with wider heads, per-layer token inputs, a 262,144-token vocabulary: the defaults too).

    python benchmarks/gpu/report_configs.py --out .
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_actq.report.presets import preset_config


def gemma3_1b_v32k():
    # The 262k-token head of the preset only adds compute to what the report compares.
    config = preset_config("gemma3-1b")
    config.vocab_size = 32768
    return config


def gemma3_2l():
    config = gemma3_1b_v32k()
    config.num_hidden_layers = 2
    config.layer_types = config.layer_types[:2]
    return config


def qwen3_5_text_defaults():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_5_text")


def gemma4_text_defaults():
    from transformers import AutoConfig

    return AutoConfig.for_model("gemma4_text")


CONFIGS = {
    "gemma3-1b-v32k": gemma3_1b_v32k,
    "gemma3-2l": gemma3_2l,
    "gemma4-text-defaults": gemma4_text_defaults,
    "qwen3_5-text-defaults": qwen3_5_text_defaults,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="where the folders go (default: here)")
    args = parser.parse_args(argv)
    for name, make in CONFIGS.items():
        make().save_pretrained(Path(args.out) / name)
        print(f"wrote {Path(args.out) / name}")


if __name__ == "__main__":
    main()
