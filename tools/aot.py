"""Compile every Triton kernel variant the dispatcher can launch, ahead of time, for real GPUs.

The interpreter accepts code the GPU compiler rejects, so each (kernel, dtype, constexpr) variant
is compiled to a cubin with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``;
no GPU is needed. Run ``python tools/aot.py --cc 80 90`` (not under TRITON_INTERPRET). A
development check, outside the package: nothing in hf_actq imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# Sizes above 2**31 - 1 are passed as i64; Triton specialises smaller ones to i32. Both launch.
INDEX_TYPES = ("i32", "i64")
FLOAT_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Stack bytes per thread a variant may use: a few spilled registers, not a spilled tile.
SPILL_LIMIT = 64


@dataclass(frozen=True)
class Variant:
    module: str
    kernel: str
    signature: dict
    constexprs: dict

    @property
    def label(self) -> str:
        parts = [self.kernel, *(f"{k}={v}" for k, v in self.constexprs.items())]
        parts += [f"{k}:{v}" for k, v in self.signature.items() if v != "constexpr"]
        return " ".join(parts)


def _variant(module, kernel, signature, constexprs):
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    return Variant(module, kernel, signature, constexprs)


def variants() -> list[Variant]:
    """Every launchable variant, derived from the launchers' own tables.

    Triton also specialises integer arguments equal to 1 and 16-byte alignment at launch; those
    variants compile the same code with constants folded, so the generic signature stands for
    them.
    """
    from hf_actq.codecs.packed import BLOCK_SIZES
    from hf_actq.codecs.smaq import BLOCK_SIZES as SMAQ_BLOCK_SIZES
    from hf_actq.fewbit.activations import ACTIVATIONS
    from hf_actq.kernels import average_quant, dropout, fewbit, mask, norm, sign_preserving
    from hf_actq.kernels.smaq import extension_bytes_pad

    out = []
    for dtype in FLOAT_TYPES.values():
        for index in INDEX_TYPES:
            forward_signature = {
                "x_ptr": f"*{dtype}",
                "y_ptr": f"*{dtype}",
                "packed_ptr": "*u8",
                "borders_ptr": "*fp32",
                "nan_flag_ptr": "*i32",
                "n_elements": index,
                "n_bytes": index,
                "num_borders": "i32",
                "bits": "i32",
                "p0": "fp32",
                "p1": "fp32",
            }
            # With the output (one variant per activation), and codes only (one per code mode,
            # as the ops launch it).
            forward_constexprs = [
                (act_id, fewbit.CODE_MODES[ACTIVATIONS[name].code_mode], True)
                for name, act_id in fewbit.ACTIVATION_IDS.items()
            ] + [(0, code_mode, False) for code_mode in fewbit.CODE_MODES.values()]
            for act_id, code_mode, store_output in forward_constexprs:
                out.append(
                    _variant(
                        "fewbit",
                        "fewbit_forward_kernel",
                        forward_signature,
                        {
                            "ACTIVATION": act_id,
                            "CODE_MODE": code_mode,
                            "GROUPS": fewbit.FORWARD_GROUPS,
                            "STORE_OUTPUT": store_output,
                        },
                    )
                )
            out.append(
                _variant(
                    "fewbit",
                    "fewbit_backward_kernel",
                    {
                        "grad_ptr": f"*{dtype}",
                        "packed_ptr": "*u8",
                        "levels_ptr": "*fp32",
                        "nan_flag_ptr": "*i32",
                        "out_ptr": f"*{dtype}",
                        "n_elements": index,
                        "n_bytes": index,
                        "bits": "i32",
                    },
                    {"BLOCK": fewbit.BACKWARD_BLOCK},
                )
            )
            out.append(
                _variant(
                    "dropout",
                    "seeded_dropout_kernel",
                    {
                        "x_ptr": f"*{dtype}",
                        "out_ptr": f"*{dtype}",
                        "n_elements": index,
                        "p": "fp32",
                        "scale": "fp32",
                        "seed": "i32",
                    },
                    {"BLOCK": dropout.BLOCK},
                )
            )
            for block in BLOCK_SIZES:
                out.append(
                    _variant(
                        "average_quant",
                        "aq_quantize_kernel",
                        {
                            "src_ptr": f"*{dtype}",
                            "packed_ptr": "*u8",
                            "mins_ptr": "*fp32",
                            "scales_ptr": "*fp32",
                            "n_means": index,
                            "n_bytes": index,
                            "group": "i32",
                            "bits": "i32",
                            "stochastic": "i32",
                            "seed": "i32",
                        },
                        {"BLOCK": block},
                    )
                )
                out.append(
                    _variant(
                        "sign_preserving",
                        "blpa_quantize_kernel",
                        {
                            "src_ptr": f"*{dtype}",
                            "packed_ptr": "*u8",
                            "steps_ptr": "*fp32",
                            "n_elements": index,
                            "n_bytes": index,
                            "bits": "i32",
                        },
                        {"BLOCK": block},
                    )
                )
            for block in SMAQ_BLOCK_SIZES:
                # Every tile a capacity in [0, 1] can ask for: slots // 4 runs 0..block // 4.
                pads = sorted({extension_bytes_pad(4 * n) for n in range(block // 4 + 1)})
                out.extend(
                    _variant(
                        "smaq",
                        "smaq_quantize_kernel",
                        {
                            "src_ptr": f"*{dtype}",
                            "stats_ptr": "*fp32",
                            "main_ptr": "*u8",
                            "ext_ptr": "*u8",
                            "n_elements": index,
                            "n_main_bytes": index,
                            "slots": "i32",
                            "stochastic": "i32",
                            "seed": "i32",
                        },
                        {"BLOCK": block, "BYTES_PAD": pad},
                    )
                    for pad in pads
                )
                out.append(
                    _variant(
                        "smaq",
                        "smaq_dequantize_kernel",
                        {
                            "main_ptr": "*u8",
                            "ext_ptr": "*u8",
                            "stats_ptr": "*fp32",
                            "out_ptr": f"*{dtype}",
                            "n_elements": index,
                            "n_main_bytes": index,
                            "n_ext_bytes": index,
                            "slots": "i32",
                        },
                        {"BLOCK": block},
                    )
                )
            out.append(
                _variant(
                    "average_quant",
                    "aq_dequantize_kernel",
                    {
                        "packed_ptr": "*u8",
                        "mins_ptr": "*fp32",
                        "scales_ptr": "*fp32",
                        "out_ptr": f"*{dtype}",
                        "n_elements": index,
                        "n_bytes": index,
                        "last": "i32",
                        "per_row": "i32",
                        "group": "i32",
                        "block": "i32",
                        "bits": "i32",
                    },
                    {"BLOCK": average_quant.DEQUANT_BLOCK},
                )
            )
            out.append(
                _variant(
                    "sign_preserving",
                    "blpa_dequantize_kernel",
                    {
                        "packed_ptr": "*u8",
                        "steps_ptr": "*fp32",
                        "out_ptr": f"*{dtype}",
                        "n_elements": index,
                        "n_bytes": index,
                        "block": "i32",
                        "bits": "i32",
                    },
                    {"BLOCK": sign_preserving.DEQUANT_BLOCK},
                )
            )
    # The norm kernels index rows and columns separately: both fit i32 at any real size.
    for dtype in FLOAT_TYPES.values():
        out.append(
            _variant(
                "norm",
                "norm_row_means_kernel",
                {
                    "grad_ptr": f"*{dtype}",
                    "xhat_ptr": f"*{dtype}",
                    "w_ptr": "*fp32",
                    "means_ptr": "*fp32",
                    "width": "i32",
                    "inv_width": "fp32",
                    "centered": "fp32",
                },
                {"BLOCK": norm.BLOCK},
            )
        )
        out.append(
            _variant(
                "norm",
                "norm_backward_kernel",
                {
                    "grad_ptr": f"*{dtype}",
                    "xhat_ptr": f"*{dtype}",
                    "w_ptr": "*fp32",
                    "rstd_ptr": "*fp32",
                    "means_ptr": "*fp32",
                    "out_ptr": f"*{dtype}",
                    "partial_w_ptr": "*fp32",
                    "partial_b_ptr": "*fp32",
                    "n_rows": "i32",
                    "width": "i32",
                    "rows_per_program": "i32",
                },
                {"BLOCK": norm.BLOCK},
            )
        )
    for dtype in ("u8", *FLOAT_TYPES.values()):
        for index in INDEX_TYPES:
            out.append(
                _variant(
                    "mask",
                    "mask_pack_kernel",
                    {
                        "src_ptr": f"*{dtype}",
                        "packed_ptr": "*u8",
                        "n_elements": index,
                        "n_bytes": index,
                    },
                    {"GROUPS": mask.GROUPS},
                )
            )
            out.append(
                _variant(
                    "mask",
                    "mask_unpack_kernel",
                    {
                        "packed_ptr": "*u8",
                        "out_ptr": f"*{dtype}",
                        "n_elements": index,
                        "n_bytes": index,
                    },
                    {"BLOCK": mask.UNPACK_BLOCK},
                )
            )
    return out


def compile_variant(variant: Variant, cc: int) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_actq.kernels.triton_common import LAUNCH_OPTIONS

    fn = getattr(importlib.import_module(f"hf_actq.kernels.{variant.module}"), variant.kernel)
    start = time.perf_counter()
    source = ASTSource(fn=fn, signature=variant.signature, constexprs=variant.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=LAUNCH_OPTIONS)
    return {
        "variant": variant.label,
        "cc": cc,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "seconds": round(time.perf_counter() - start, 3),
        **resource_usage(compiled.asm["cubin"]),
    }


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes per thread (where registers spill: SmaQ's quantize
    kernel once had 3.5 KB, and ran 300-1400x two copies on an H200), read by the cuobjdump
    that ships with Triton; {} where there is none."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [str(tool), "-res-usage", file.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found[1]), "stack_bytes": int(found[2])} if found else {}


def _compile_star(args):
    return compile_variant(*args)


def representatives(all_variants: list[Variant], per: str = "types") -> list[Variant]:
    """One variant per kernel and argument types (``per="types"``: every float type and index
    width each kernel takes), or per kernel (``per="kernel"``: its bf16 variant where it has
    one, bf16 rounding being the hand-written path). The variants left out differ only in
    folded constexprs (block sizes, activation branches) or argument types, which the full
    compile covers."""
    chosen: dict[tuple, Variant] = {}
    for variant in all_variants:
        types = tuple(t for t in variant.signature.values() if t != "constexpr")
        key = (variant.kernel, types) if per == "types" else (variant.kernel,)
        if key not in chosen or ("bf16" in variant.label and "bf16" not in chosen[key].label):
            chosen[key] = variant
    return list(chosen.values())


def compile_all(
    ccs=(80, 90), jobs: int = 2, representative: str | None = None, match: str | None = None
) -> list[dict]:
    chosen = representatives(variants(), representative) if representative else variants()
    chosen = [v for v in chosen if match is None or match in v.label]
    work = [(v, cc) for v in chosen for cc in ccs]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_compile_star, work, chunksize=4))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cc", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write the per-variant results here")
    parser.add_argument(
        "--representative",
        choices=["types", "kernel"],
        help="one variant per kernel and argument types, or per kernel, instead of every "
        "constexpr choice",
    )
    parser.add_argument("--match", help="only the variants whose label holds this text")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = compile_all(tuple(args.cc), args.jobs, args.representative, args.match)
    if not results:
        sys.exit(f"no kernel variant's label holds {args.match!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    empty = [r for r in results if r["cubin_bytes"] == 0]
    spilling = [r for r in results if r.get("stack_bytes", 0) > SPILL_LIMIT]
    print(
        f"compiled {len(results)} kernel variants for sm_{', sm_'.join(map(str, args.cc))} "
        f"in {time.perf_counter() - start:.1f} s; {len(empty)} empty cubins; "
        f"{len(spilling)} with over {SPILL_LIMIT} stack bytes per thread"
    )
    for result in spilling:
        print(f"  {result['variant']} sm_{result['cc']}: {result['stack_bytes']} stack bytes")
    return 1 if empty or spilling else 0


if __name__ == "__main__":
    sys.exit(main())
