"""Compile every Triton kernel variant the dispatcher can launch, ahead of time, for real GPUs.

The interpreter accepts code the GPU compiler rejects, so each (kernel, dtype, constexpr) variant
is compiled to a cubin with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``;
no GPU is needed. Run ``python tools/aot.py --cc 80 90`` (not under TRITON_INTERPRET). A
development check, outside the package: nothing in hf_actq imports it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
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
    options: dict | None = None  # compile options other than the launchers' LAUNCH_OPTIONS

    @property
    def label(self) -> str:
        parts = [self.kernel, *(f"{k}={v}" for k, v in self.constexprs.items())]
        parts += [f"{k}:{v}" for k, v in self.signature.items() if v != "constexpr"]
        return " ".join(parts)


def _variant(module, kernel, signature, constexprs, options=None):
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    return Variant(module, kernel, signature, constexprs, options)


# (bits, group, block) of act(gate)'s and up's packs in the gated backward variants.
GATED_LAYOUTS = (
    ((4, 1, 128), (4, 1, 128)),
    ((2, 4, 128), (2, 4, 128)),
    ((1, 16, 256), (8, 1, 32)),
)


def _gated_backward(dtype, index, a, up, bits, with_product):
    from hf_actq.kernels import average_quant, gated_product

    signature = {"grad_ptr": f"*{dtype}"}
    for operand in ("a", "up"):
        signature |= {f"{operand}_data_ptr": "*u8", f"{operand}_mins_ptr": "*fp32"}
        signature[f"{operand}_scales_ptr"] = "*fp32"
    signature |= {"codes_ptr": "*u8", "levels_ptr": "*fp32", "nan_flag_ptr": "*i32"}
    signature |= {name: f"*{dtype}" for name in ("grad_gate_ptr", "grad_up_ptr", "product_ptr")}
    signature |= dict.fromkeys(("n_elements", "a_bytes", "up_bytes", "code_bytes"), index)
    constexprs = {}
    for operand, (codec_bits, group, block) in (("A", a), ("UP", up)):
        constexprs |= {f"{operand}_BITS": codec_bits, f"{operand}_GROUP": group}
        constexprs[f"{operand}_BLOCK"] = block
        constexprs[f"{operand}_ROWS"] = average_quant._rows_per_tile(block, group)
    constexprs |= {"BITS": bits, "WITH_PRODUCT": with_product, "ROWS": gated_product.ROWS}
    return _variant(
        "gated_product", "gated_backward_kernel", signature, constexprs, gated_product.OPTIONS
    )


def _gated_forward(dtype, index, a, up, bits, activation, strided=False):
    from hf_actq.kernels import average_quant, fewbit, gated_product

    signature = {name: f"*{dtype}" for name in ("gate_ptr", "up_ptr", "product_ptr")}
    signature |= {"codes_ptr": "*u8", "borders_ptr": "*fp32", "nan_flag_ptr": "*i32"}
    for operand in ("a", "up"):
        signature |= {f"{operand}_data_ptr": "*u8", f"{operand}_mins_ptr": "*fp32"}
        signature[f"{operand}_scales_ptr"] = "*fp32"
    signature |= dict.fromkeys(("n_elements", "code_bytes", "a_bytes", "up_bytes"), index)
    signature |= {"a_key": "i32", "up_key": "i32", "p0": "fp32", "p1": "fp32"}
    signature |= {"width": "i32", "inv_width": "fp32", "row_stride": "i32"}
    constexprs = {
        "ACTIVATION": fewbit.ACTIVATION_IDS[activation],
        "CODE_MODE": fewbit.CODE_MODES["table"],
        "NUM_BORDERS": 2**bits - 1,
        "BITS": bits,
        "LIBDEVICE": True,
    }
    for operand, (codec_bits, group, block) in (("A", a), ("UP", up)):
        constexprs |= {f"{operand}_STOCHASTIC": True, f"{operand}_BITS": codec_bits}
        constexprs |= {f"{operand}_GROUP": group, f"{operand}_BLOCK": block}
        constexprs[f"{operand}_ROWS"] = average_quant._rows_per_tile(block, group)
    constexprs |= {"STRIDED": strided, "ROWS": gated_product.ROWS}
    options = fewbit.EXACT_OPTION_CANDIDATES[0]
    return _variant("gated_product", "gated_forward_kernel", signature, constexprs, options)


def _fewbit_forward(signature, activation, code_mode, num_borders, bits, options):
    from hf_actq.kernels import fewbit

    constexprs = {
        "ACTIVATION": fewbit.ACTIVATION_IDS[activation] if activation else 0,
        "CODE_MODE": fewbit.CODE_MODES[code_mode],
        "NUM_BORDERS": num_borders,
        "BITS": bits,
        "STORE_OUTPUT": bool(activation),
        "LIBDEVICE": bool(activation),
        "ROWS": fewbit.ROWS,
    }
    return _variant("fewbit", "fewbit_forward_kernel", signature, constexprs, options)


def rotated_shapes(block_sizes) -> list[tuple[int, int]]:
    """(bits, block) of the rotated codec's kernels compiled ahead of time: every width at
    block 128, every block at 4 bits (the "checkpoint" recipe's)."""
    return [(bits, 128) for bits in range(1, 9)] + [(4, b) for b in block_sizes if b != 128]


def _rotated(dtype, index, block_sizes) -> list[Variant]:
    """The rotated pack (deterministic, stochastic with the seed as an argument and read from
    memory) and unpack per shape, with the tile the launcher picks for the coefficients'
    dtype, the codec's (column-major) matrix."""
    import torch
    import triton.language as tl

    from hf_actq.kernels import rotated

    coeff = "bf16" if dtype == "bf16" else "fp32"
    rows, parts, options = rotated.tile_shape(torch.bfloat16 if coeff == "bf16" else torch.float32)
    out = []
    for bits, block in rotated_shapes(block_sizes):
        shape = {"BITS": bits, "BLOCK": block, "ROWS": rows, "DOT_DTYPE": tl.bfloat16}
        shape |= {"ROW_STRIDE": 1, "COLUMN_STRIDE": 128, "PARTS": parts}
        for stochastic, seed_in_memory in ((False, False), (True, False), (True, True)):
            signature = {
                "src_ptr": f"*{dtype}",
                "rotation_ptr": f"*{coeff}",
                "packed_ptr": "*u8",
                "mins_ptr": "*fp32",
                "scales_ptr": "*fp32",
                "n_elements": index,
                "n_bytes": index,
                "noise_key": "i32",
                "seed_ptr": "*i64" if seed_in_memory else f"*{dtype}",
                "tiles": "i32",
            }
            flags = {"STOCHASTIC": stochastic, "SEED_IN_MEMORY": seed_in_memory}
            out.append(
                _variant("rotated", "rotated_quantize_kernel", signature, flags | shape, options)
            )
        signature = {
            "packed_ptr": "*u8",
            "mins_ptr": "*fp32",
            "scales_ptr": "*fp32",
            "rotation_ptr": f"*{coeff}",
            "out_ptr": f"*{dtype}",
            "n_elements": index,
            "n_bytes": index,
            "tiles": "i32",
        }
        out.append(_variant("rotated", "rotated_dequantize_kernel", signature, shape, options))
    return out


# The strided pack (attention's q, k and v as they lie): "uniform" 4 bits, 3 bits and ALAM's
# 2-bit groups, at the common head dims.
STRIDED_CODECS = ((4, 1, 128), (3, 1, 64), (2, 4, 128))
STRIDED_WIDTHS = (32, 64, 128)
# BLPA's (bits, block): its default and 2 bits.
STRIDED_BLPA = ((4, 128), (2, 128))
# SmaQ's default block.
STRIDED_SMAQ_BLOCK = 256


def codec_shapes(block_sizes) -> list[tuple[int, int, int]]:
    """(bits, group, block) of the codec kernels compiled ahead of time: every width at group 1
    and every block size; every group at ALAM's 2 bits and at 3 (the width packed byte by
    byte), block 128; the largest run (group 16, block 256: one block a program). The other
    combinations compile the same code paths with other constants (the JIT compiles them as
    they are launched)."""
    shapes = [(bits, 1, block) for bits in range(1, 9) for block in block_sizes]
    shapes += [(bits, group, 128) for group in (2, 4, 8, 16) for bits in (2, 3)]
    return shapes + [(2, 16, 256)]


def variants() -> list[Variant]:
    """Every launchable variant, derived from the launchers' own tables.

    Triton also specialises integer arguments equal to 1 and 16-byte alignment at launch; those
    variants compile the same code with constants folded, so the generic signature stands for
    them.
    """
    from hf_actq.codecs.packed import BLOCK_SIZES
    from hf_actq.codecs.smaq import BLOCK_SIZES as SMAQ_BLOCK_SIZES
    from hf_actq.codecs.smaq import SmaQCodec
    from hf_actq.fewbit.dp import MAX_BITS
    from hf_actq.kernels import average_quant, dropout, fewbit, mask, norm, sign_preserving, smaq
    from hf_actq.kernels.smaq import extension_bytes_pad

    out = []
    for dtype in FLOAT_TYPES.values():
        for index in INDEX_TYPES:
            # The last arguments of every strided pack kernel (strided_rows_tile's).
            strided = {"n_heads": "i32", "n_rows": "i32"}
            strided |= dict.fromkeys(("stride_batch", "stride_head", "stride_row"), index)
            forward_signature = {
                "x_ptr": f"*{dtype}",
                "y_ptr": f"*{dtype}",
                "packed_ptr": "*u8",
                "borders_ptr": "*fp32",
                "nan_flag_ptr": "*i32",
                "n_elements": index,
                "n_bytes": index,
                "p0": "fp32",
                "p1": "fp32",
            }
            # As the ops launch it on a GPU: codes only (one variant per code mode and width),
            # and the fused forward of each activation it reproduces, with its compile options.
            for bits in range(1, MAX_BITS + 1):
                for mode in ("table", "symmetric") if bits > 1 else tuple(fewbit.CODE_MODES):
                    borders = {"interval": 2, "threshold": 1}.get(mode, 2**bits - 1)
                    out.append(_fewbit_forward(forward_signature, 0, mode, borders, bits, None))
            for name in sorted(fewbit.FUSED_ACTIVATIONS):
                for bits in (1, 3):
                    options = fewbit.EXACT_OPTION_CANDIDATES[0]
                    out.append(
                        _fewbit_forward(
                            forward_signature, name, "table", 2**bits - 1, bits, options
                        )
                    )
            for bits in range(1, MAX_BITS + 1):
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
                        },
                        {"BITS": bits, "ROWS": fewbit.ROWS},
                    )
                )
            # The gated product's backward: uniform 4-bit (the recipes' width), ALAM's 0.5-bit
            # AQ, and the widest layouts apart; a 1- and a 3-bit few-bit code; with and without
            # down's input.
            for a, up in GATED_LAYOUTS:
                for bits in (1, 3):
                    for with_product in (False, True):
                        out.append(_gated_backward(dtype, index, a, up, bits, with_product))
                    # The forward, fused with LLaMA's and GPT-style models' activations.
                    for activation in ("silu", "gelu"):
                        out.append(_gated_forward(dtype, index, a, up, bits, activation))
                # gate and up as the halves of one projection's output (Phi-3, MoE experts).
                out.append(_gated_forward(dtype, index, a, up, 1, "silu", strided=True))
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
            for bits, group, block in codec_shapes(BLOCK_SIZES):
                rows = average_quant._rows_per_tile(block, group)
                # Stochastic: the seed as an argument (eager) or read from memory (compiled).
                for stochastic, seed_in_memory in ((False, False), (True, False), (True, True)):
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
                                "noise_key": "i32",
                                # Without a seed in memory the launcher passes the source.
                                "seed_ptr": "*i64" if seed_in_memory else f"*{dtype}",
                            },
                            {
                                "STOCHASTIC": stochastic,
                                "SEED_IN_MEMORY": seed_in_memory,
                                "BITS": bits,
                                "GROUP": group,
                                "BLOCK": block,
                                "ROWS": rows,
                            },
                        )
                    )
                if (bits, group, block) in STRIDED_CODECS:
                    for width, (stochastic, seed_in_memory) in itertools.product(
                        STRIDED_WIDTHS, ((False, False), (True, False), (True, True))
                    ):
                        signature = {
                            "src_ptr": f"*{dtype}",
                            "packed_ptr": "*u8",
                            "mins_ptr": "*fp32",
                            "scales_ptr": "*fp32",
                            "n_bytes": index,
                            "noise_key": "i32",
                            "seed_ptr": "*i64" if seed_in_memory else f"*{dtype}",
                        } | strided
                        constants = {"STOCHASTIC": stochastic, "SEED_IN_MEMORY": seed_in_memory}
                        constants |= {"BITS": bits, "GROUP": group, "BLOCK": block}
                        constants |= {"ROWS": rows, "WIDTH": width}
                        out.append(
                            _variant(
                                "average_quant", "aq_quantize_strided_kernel", signature, constants
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
                            "n_means": index,
                            "n_bytes": index,
                        },
                        {"BITS": bits, "GROUP": group, "BLOCK": block, "ROWS": rows},
                    )
                )
                if group == 1:
                    blpa = {
                        "BITS": bits,
                        "BLOCK": block,
                        "ROWS": sign_preserving._rows_per_tile(block),
                    }
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
                            },
                            blpa,
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
                            },
                            blpa,
                        )
                    )
                    if (bits, block) in STRIDED_BLPA:
                        signature = {"src_ptr": f"*{dtype}", "packed_ptr": "*u8"}
                        signature |= {"steps_ptr": "*fp32", "n_bytes": index} | strided
                        out += [
                            _variant(
                                "sign_preserving",
                                "blpa_quantize_strided_kernel",
                                signature,
                                {**blpa, "WIDTH": width},
                            )
                            for width in STRIDED_WIDTHS
                        ]
            out += _rotated(dtype, index, BLOCK_SIZES)
            out.append(
                _variant(
                    "smaq",
                    "smaq_stats_kernel",
                    {
                        "src_ptr": f"*{dtype}",
                        "partials_ptr": "*fp32",
                        "n_elements": index,
                        "n_tiles": index,
                    },
                    {"ROWS": smaq.STATS_ROWS, "COLS": smaq.STATS_COLS},
                )
            )
            out += [
                _variant(
                    "smaq",
                    "smaq_stats_strided_kernel",
                    {"src_ptr": f"*{dtype}", "partials_ptr": "*fp32", "n_tiles": index} | strided,
                    {"ROWS": smaq.STATS_ROWS, "COLS": smaq.STATS_COLS, "WIDTH": width},
                )
                for width in STRIDED_WIDTHS
            ]
            if dtype == "fp32":  # the partials are fp32 whatever the tensor's dtype
                signature = {"partials_ptr": "*fp32", "stats_ptr": "*fp32"}
                signature |= {"n_elements": index, "n_tiles": index}
                chunk = {"TILE": smaq.TILE_ELEMENTS, "CHUNK": smaq.COMBINE_CHUNK}
                out.append(_variant("smaq", "smaq_combine_kernel", signature, chunk))
            for block in SMAQ_BLOCK_SIZES:
                # Every tile a capacity in [0, 1] can ask for: slots // 4 runs 0..block // 4.
                pads = sorted({extension_bytes_pad(4 * n) for n in range(block // 4 + 1)})
                rows = {"BLOCK": block, "ROWS": smaq._rows_per_tile(block)}
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
                            "noise_key": "i32",
                            # Without a seed in memory the launcher passes the statistics.
                            "seed_ptr": "*i64" if seed_in_memory else "*fp32",
                        },
                        rows
                        | {"BYTES_PAD": pad, "STOCHASTIC": stochastic}
                        | {"SEED_IN_MEMORY": seed_in_memory},
                    )
                    for pad in pads
                    for stochastic, seed_in_memory in ((False, False), (True, False), (True, True))
                )
                if block == STRIDED_SMAQ_BLOCK:  # the default capacity's tile, every seed form
                    pad = extension_bytes_pad(SmaQCodec(block_size=block).slots)
                    signature = {"src_ptr": f"*{dtype}", "stats_ptr": "*fp32"}
                    signature |= {"main_ptr": "*u8", "ext_ptr": "*u8", "n_main_bytes": index}
                    signature |= {"slots": "i32", "noise_key": "i32"}
                    out += [
                        _variant(
                            "smaq",
                            "smaq_quantize_strided_kernel",
                            signature
                            | {"seed_ptr": "*i64" if seed_in_memory else "*fp32"}
                            | strided,
                            rows
                            | {"BYTES_PAD": pad, "STOCHASTIC": stochastic}
                            | {"SEED_IN_MEMORY": seed_in_memory, "WIDTH": width},
                        )
                        for width in STRIDED_WIDTHS
                        for stochastic, seed_in_memory in (
                            (False, False),
                            (True, False),
                            (True, True),
                        )
                    ]
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
                            "slots": "i32",
                        },
                        rows,
                    )
                )
    # The norm backward kernels index rows and columns separately: both fit i32 at any real
    # size. Each reads x_hat as a tensor, dequantizes it from its pack (PACKED), or rebuilds it
    # from a memory-sharing norm's output (FROM_OUTPUT: a LayerNorm's with its bias and guard
    # column, an RMSNorm's with its guard column, a LayerNorm's without weight).
    sources = [(False, (8, 1, 32), False, False, False)]
    sources += [(True, codec, False, False, False)
                for codec in ((4, 1, 128), (3, 4, 64), (2, 16, 256))]  # fmt: skip
    sources += [(False, (8, 1, 32), True, *bias_and_guard)
                for bias_and_guard in ((True, True), (False, True), (False, False))]  # fmt: skip
    for dtype in FLOAT_TYPES.values():
        for packed, (bits, group, block), from_output, has_bias, guard in sources:
            layout = {"PACKED": packed, "BITS": bits, "GROUP": group, "CODEC_BLOCK": block}
            layout |= {"FROM_OUTPUT": from_output, "HAS_BIAS": has_bias, "GUARD": guard}
            operands = {"grad_ptr": f"*{dtype}", "xhat_ptr": f"*{dtype}", "data_ptr": "*u8"}
            operands |= {"mins_ptr": "*fp32", "scales_ptr": "*fp32", "w_ptr": f"*{dtype}"}
            operands["w_offset"] = "fp32"
            # Where they are not read, the launcher passes tensors of the other forms.
            operands["bias_ptr"] = f"*{dtype}"
            operands["guard_index_ptr"] = "*i64" if guard else "*fp32"
            operands["guard_ptr"] = f"*{dtype}"
            means = {"means_ptr": "*fp32", "width": "i32", "inv_width": "fp32"}
            means |= {"centered": "fp32", "n_bytes": "i64"}
            out.append(
                _variant(
                    "norm",
                    "norm_row_means_kernel",
                    operands | means,
                    layout | {"BLOCK": norm.BLOCK},
                )
            )
            backward = {"rstd_ptr": "*fp32", "means_ptr": "*fp32", "out_ptr": f"*{dtype}"}
            backward |= {"partial_ptr": "*fp32", "n_rows": "i32", "width": "i32"}
            backward |= {"rows_per_program": "i32", "row_blocks": "i32", "n_bytes": "i64"}
            out.append(
                _variant(
                    "norm",
                    "norm_backward_kernel",
                    operands | backward,
                    layout | {"BLOCK": norm.BLOCK},
                )
            )
        # The forward: LayerNorm (x_hat only), LLaMA's and Gemma's RMSNorm (and the output).
        for centered, with_output, offset_form in ((True, False, False), (False, True, False),
                                                   (False, True, True)):  # fmt: skip
            for bits, group, block in ((4, 1, 128), (2, 4, 128), (3, 16, 256)):
                signature = {"x_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
                signature |= {"w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "data_ptr": "*u8"}
                signature |= {"mins_ptr": "*fp32", "scales_ptr": "*fp32", "n_elements": "i64"}
                signature |= {"width": "i32", "inv_width": "fp32", "n_bytes": "i64"}
                signature |= {"key": "i32", "offset": "fp32"}
                constexprs = {"CENTERED": centered, "WITH_OUTPUT": with_output}
                constexprs |= {"OFFSET_FORM": offset_form, "STOCHASTIC": True, "BITS": bits}
                constexprs |= {"GROUP": group, "BLOCK": block}
                constexprs["CODEC_ROWS"] = average_quant._rows_per_tile(block, group)
                constexprs["ROWS"] = norm.ROWS
                out.append(_variant("norm", "norm_pack_kernel", signature, constexprs))
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
                    {"ROWS": mask.ROWS},
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
                    {"ROWS": mask.ROWS},
                )
            )
    return out


# Kernels that stream a tensor and must run at memory bandwidth (the codecs' packs and unpacks):
# aot.py fails a variant of theirs that divides integers in software (a 64-bit `//` or `%` by a
# runtime value is a subroutine of about 80 instructions), moves its float tensor without
# 128-bit accesses, or spills. The first GPU run found all three in the kernels before these.
BANDWIDTH_KERNELS = {
    "fewbit_forward_kernel": "LDG.E.128",
    "fewbit_backward_kernel": "STG.E.128",
    "gated_backward_kernel": "STG.E.128",
    "gated_forward_kernel": "LDG.E.128",
    "aq_quantize_kernel": "LDG.E.128",
    "aq_quantize_strided_kernel": "LDG.E.128",
    "aq_dequantize_kernel": "STG.E.128",
    "blpa_quantize_kernel": "LDG.E.128",
    "blpa_quantize_strided_kernel": "LDG.E.128",
    "blpa_dequantize_kernel": "STG.E.128",
    "mask_pack_kernel": "LDG.E.128",
    "mask_unpack_kernel": "STG.E.128",
    "norm_pack_kernel": "LDG.E.128",
    "norm_row_means_kernel": "LDG.E.128",
    "norm_backward_kernel": "STG.E.128",
    "smaq_stats_kernel": "LDG.E.128",
    "smaq_stats_strided_kernel": "LDG.E.128",
    "smaq_quantize_kernel": "LDG.E.128",
    "smaq_quantize_strided_kernel": "LDG.E.128",
    "smaq_dequantize_kernel": "STG.E.128",
    "rotated_quantize_kernel": "LDG.E.128",
    "rotated_dequantize_kernel": "STG.E.128",
    "seeded_dropout_kernel": "LDG.E.128",
}
_INTEGER_DIVISION = re.compile(r"\b(div|rem)\.[su](32|64)\b")


def aligned_names(variant: Variant) -> list[str]:
    """The arguments the JIT marks as 16-aligned on a launch on PyTorch's allocations: pointers
    (16-byte aligned) and sizes that are multiples of 16 (the common case, and the one whose
    code the JIT runs at scale): element counts, a norm's row width (every real hidden size)
    and the strides of a strided pack's rows. Without them a cubin shows scalar loads where the
    JIT's has 128-bit ones."""
    return [
        name
        for name, kind in variant.signature.items()
        if kind.startswith("*")
        or (kind in INDEX_TYPES and name.startswith("n_"))
        or (kind == "i32" and name == "width")
        or (kind in INDEX_TYPES and name.startswith("stride_"))  # q, k, v: heads x head dim
    ]


def aligned_arguments(variant: Variant) -> dict:
    """:func:`aligned_names` as the newest Triton's ``ASTSource`` takes them."""
    positions = list(variant.signature)
    return {(positions.index(name),): [["tt.divisibility", 16]] for name in aligned_names(variant)}


def compile_variant(variant: Variant, cc: int) -> dict:
    import importlib

    fn = getattr(importlib.import_module(f"hf_actq.kernels.{variant.module}"), variant.kernel)
    return compile_kernel(fn, variant, cc)


def compile_kernel(fn, variant: Variant, cc: int) -> dict:
    """``fn`` (a ``triton.jit`` function) compiled as ``variant`` for sm_``cc``, with what its
    cubin uses and what keeps it from streaming if it is a bandwidth kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_actq.kernels.triton_common import LAUNCH_OPTIONS

    start = time.perf_counter()
    source = _source(ASTSource, fn, variant)
    options = variant.options or LAUNCH_OPTIONS
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=options)
    result = {
        "variant": variant.label,
        "kernel": variant.kernel,
        "cc": cc,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "seconds": round(time.perf_counter() - start, 3),
        "integer_divisions": len(_INTEGER_DIVISION.findall(compiled.asm["ptx"])),
        **resource_usage(compiled.asm["cubin"]),
    }
    result["problems"] = bandwidth_problems(result)
    return result


def _source(ast_source, fn, variant: Variant):
    """``ASTSource`` of ``variant``, as the installed Triton takes it: by argument name with
    constexprs and attribute lists (the newest, 3.9 when written), or by argument index with
    constants and an AttrsDescriptor (3.1, the one PyTorch 2.5 pins, the ``triton`` extra's
    floor). Versions between these two are not tried here."""
    import inspect

    if "constexprs" in inspect.signature(ast_source).parameters:
        return ast_source(
            fn=fn,
            signature=variant.signature,
            constexprs=variant.constexprs,
            attrs=aligned_arguments(variant),
        )
    from triton.compiler.compiler import AttrsDescriptor

    index = {name: position for position, name in enumerate(fn.arg_names)}
    signature = {index[name]: kind for name, kind in variant.signature.items()}
    aligned = {index[name] for name in aligned_names(variant)}
    return ast_source(
        fn,
        {position: kind for position, kind in signature.items() if kind != "constexpr"},
        constants={index[name]: value for name, value in variant.constexprs.items()},
        attrs=AttrsDescriptor(divisible_by_16=aligned, equal_to_1=set()),
    )


def bandwidth_problems(result: dict) -> list[str]:
    """What keeps a bandwidth kernel's variant from streaming (nothing for other kernels)."""
    wide = BANDWIDTH_KERNELS.get(result["kernel"])
    if wide is None:
        return []
    problems = []
    if result["integer_divisions"]:
        problems.append(f"{result['integer_divisions']} integer divisions in software")
    if "sass" in result and result["sass"].get(wide, 0) == 0:
        problems.append(f"no {wide}: the float tensor moves in scalar accesses")
    if result.get("stack_bytes", 0) > 0:
        problems.append(f"{result['stack_bytes']} stack bytes per thread")
    return problems


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread (where registers spill: SmaQ's quantize kernel once
    had 3.5 KB, and ran 300-1400x two copies on an H200), and the count of each global memory,
    barrier and call instruction in the SASS, read by the cuobjdump that ships with Triton; {}
    where there is none."""
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
        sass = subprocess.run([str(tool), "-sass", file.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if not found:
        return {}
    counts: dict[str, int] = {}
    for opcode in _SASS_OPCODE.findall(sass.stdout):
        if opcode.startswith(("LDG", "STG", "BAR", "CALL")):
            counts[opcode] = counts.get(opcode, 0) + 1
    return {"registers": int(found[1]), "stack_bytes": int(found[2]), "sass": counts}


# An instruction line of cuobjdump's SASS: `/*0120*/  @!P0 LDG.E.128 R4, desc[...][R2.64] ;`
_SASS_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


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
    ccs=(80, 90),
    jobs: int = 2,
    representative: str | None = None,
    match: list[list[str]] | None = None,
) -> list[dict]:
    """``match``: groups of texts; a variant is compiled when its label holds every text of
    one group (all variants without groups)."""
    chosen = representatives(variants(), representative) if representative else variants()
    if match:
        chosen = [v for v in chosen if any(all(t in v.label for t in texts) for texts in match)]
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
    parser.add_argument(
        "--match",
        nargs="+",
        action="append",
        help="only the variants whose label holds each of these texts; given again, the "
        "variants either selects",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = compile_all(tuple(args.cc), args.jobs, args.representative, args.match)
    if not results:
        groups = " or ".join(repr(" ".join(texts)) for texts in args.match or ())
        sys.exit(f"no kernel variant's label holds each text of {groups}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    empty = [r for r in results if r["cubin_bytes"] == 0]
    spilling = [r for r in results if r.get("stack_bytes", 0) > SPILL_LIMIT]
    slow = [r for r in results if r["problems"]]
    print(
        f"compiled {len(results)} kernel variants for sm_{', sm_'.join(map(str, args.cc))} "
        f"in {time.perf_counter() - start:.1f} s; {len(empty)} empty cubins; "
        f"{len(spilling)} with over {SPILL_LIMIT} stack bytes per thread; "
        f"{len(slow)} bandwidth kernel variants that cannot stream"
    )
    for result in spilling:
        print(f"  {result['variant']} sm_{result['cc']}: {result['stack_bytes']} stack bytes")
    for result in slow:
        print(f"  {result['variant']} sm_{result['cc']}: {'; '.join(result['problems'])}")
    return 1 if empty or spilling or slow else 0


if __name__ == "__main__":
    sys.exit(main())
