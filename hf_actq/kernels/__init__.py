"""Kernel dispatch, in one place: CUDA tensors with Triton importable run the Triton kernels,
everything else runs the PyTorch twins in ``reference.py``.

Set ``HF_ACTQ_DISABLE_TRITON=1`` to force the twins on GPU too (debugging, bisecting).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_actq.kernels.reference import (
    aq_dequantize_reference,
    aq_quantize_reference,
    blpa_dequantize_reference,
    blpa_quantize_reference,
    fewbit_backward_reference,
    fewbit_forward_reference,
    mask_pack_reference,
    mask_unpack_reference,
    norm_backward_reference,
    pack_codes,
    packed_nbytes,
    seeded_dropout_reference,
    smaq_dequantize_reference,
    smaq_quantize_reference,
    unpack_codes,
)

__all__ = [
    "aq_dequantize",
    "aq_quantize",
    "blpa_dequantize",
    "blpa_quantize",
    "fewbit_backward",
    "fewbit_forward",
    "mask_pack",
    "mask_unpack",
    "norm_backward",
    "smaq_dequantize",
    "smaq_quantize",
    "pack_codes",
    "packed_nbytes",
    "seeded_dropout",
    "triton_available",
    "unpack_codes",
    "uses_triton",
]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK_TRITON_DTYPES = (torch.bool, torch.uint8, *_TRITON_DTYPES)
logger = logging.getLogger("hf_actq")

# Kernels that failed to compile or launch, with why: their twins run from then on.
FAILED: dict[str, str] = {}


def uses_triton(tensor: torch.Tensor, dtypes=_TRITON_DTYPES) -> bool:
    """Whether ops on ``tensor`` run the Triton kernels. Not while torch.compile traces a
    backward with fake tensors, which a kernel cannot take: the twin is traced and compiled."""
    return (
        tensor.is_cuda
        and tensor.dtype in dtypes
        and os.environ.get("HF_ACTQ_DISABLE_TRITON", "0") in ("", "0")
        and triton_available()
        and not is_fake(tensor)
    )


def _dispatch(kernel: str, use_triton: bool, twin, *args):
    """``kernel`` (``"<module>.<launcher>"`` under ``hf_actq.kernels``) on ``args`` when
    ``use_triton``, else ``twin``. A kernel that fails to compile or launch (an older GPU,
    another Triton version) is logged once, by name, and its twin runs instead, then and from
    then on: a kernel never ends a user's training. (A launch that fails asynchronously, after
    the call returned, leaves the CUDA context unusable; nothing can catch that here.)"""
    if use_triton and kernel not in FAILED:
        module, launcher = kernel.split(".")
        try:
            function = getattr(importlib.import_module(f"hf_actq.kernels.{module}"), launcher)
            return function(*args)
        except Exception as error:  # noqa: BLE001 (compiler, resources, driver: any of them)
            FAILED[kernel] = f"{type(error).__name__}: {str(error)[:300]}"
            logger.warning(
                "hf_actq: the Triton kernel %s failed (%s); its PyTorch twin runs instead from "
                "now on (slower, same results). Set HF_ACTQ_DISABLE_TRITON=1 to skip the kernels.",
                kernel,
                FAILED[kernel],
            )
    return twin(*args)


def fewbit_forward(x, activation, borders, bits, params=(), output=True):
    if not output:  # codes only: the op torch.compile traces as one node
        return (None, *torch.ops.hf_actq.fewbit_codes(x, activation, borders, bits, list(params)))
    return _fewbit_forward(x, activation, borders, bits, params, output)


def _fewbit_forward(x, activation, borders, bits, params, output):
    return _dispatch(
        "fewbit.fewbit_forward_triton", uses_triton(x), fewbit_forward_reference,
        x, activation, borders, bits, params, output,
    )  # fmt: skip


@torch.library.custom_op("hf_actq::fewbit_codes", mutates_args=())
def _fewbit_codes(
    x: torch.Tensor, activation: str, borders: torch.Tensor, bits: int, params: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    _, packed, nan_flag = _fewbit_forward(x, activation, borders, bits, tuple(params), False)
    return packed, nan_flag


@_fewbit_codes.register_fake
def _(x, activation, borders, bits, params):
    return (
        x.new_empty(packed_nbytes(x.numel(), bits), dtype=torch.uint8),
        x.new_empty(1, dtype=torch.int32),
    )


@torch.library.custom_op("hf_actq::fewbit_backward", mutates_args=())
def fewbit_backward(
    grad_y: torch.Tensor,
    packed: torch.Tensor,
    levels: torch.Tensor,
    nan_flag: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    return _dispatch(
        "fewbit.fewbit_backward_triton", uses_triton(grad_y), fewbit_backward_reference,
        grad_y, packed, levels, nan_flag, bits,
    )  # fmt: skip


@fewbit_backward.register_fake
def _(grad_y, packed, levels, nan_flag, bits):
    return torch.empty_like(grad_y, memory_format=torch.contiguous_format)


def aq_quantize(source, group, bits, block, stochastic, seed=0):
    return _dispatch(
        "average_quant.aq_quantize_triton", uses_triton(source), aq_quantize_reference,
        source, group, bits, block, stochastic, seed,
    )  # fmt: skip


def aq_dequantize(data, mins, scales, shape, dtype, bits, group, block):
    return _dispatch(
        "average_quant.aq_dequantize_triton",
        uses_triton(mins) and dtype in _TRITON_DTYPES, aq_dequantize_reference,
        data, mins, scales, shape, dtype, bits, group, block,
    )  # fmt: skip


def blpa_quantize(source, bits, block):
    return _dispatch(
        "sign_preserving.blpa_quantize_triton", uses_triton(source), blpa_quantize_reference,
        source, bits, block,
    )  # fmt: skip


def blpa_dequantize(data, steps, shape, dtype, bits, block):
    return _dispatch(
        "sign_preserving.blpa_dequantize_triton",
        uses_triton(steps) and dtype in _TRITON_DTYPES, blpa_dequantize_reference,
        data, steps, shape, dtype, bits, block,
    )  # fmt: skip


def mask_pack(source):
    return _dispatch(
        "mask.mask_pack_triton", uses_triton(source, _MASK_TRITON_DTYPES), mask_pack_reference,
        source,
    )  # fmt: skip


def mask_unpack(data, shape, dtype):
    return _dispatch(
        "mask.mask_unpack_triton",
        uses_triton(data, (torch.uint8,)) and dtype in _MASK_TRITON_DTYPES, mask_unpack_reference,
        data, shape, dtype,
    )  # fmt: skip


def smaq_quantize(source, stats, block, slots, stochastic, seed=0):
    return _dispatch(
        "smaq.smaq_quantize_triton", uses_triton(source), smaq_quantize_reference,
        source, stats, block, slots, stochastic, seed,
    )  # fmt: skip


def smaq_dequantize(main, extension, stats, shape, dtype, block, slots):
    return _dispatch(
        "smaq.smaq_dequantize_triton",
        uses_triton(stats) and dtype in _TRITON_DTYPES, smaq_dequantize_reference,
        main, extension, stats, shape, dtype, block, slots,
    )  # fmt: skip


def seeded_dropout(x, p, seed):
    return _dispatch(
        "dropout.seeded_dropout_triton", uses_triton(x), seeded_dropout_reference, x, p, seed
    )


def norm_backward(grad_y, x_hat, rstd, weight, centered):
    return _dispatch(
        "norm.norm_backward_triton", uses_triton(grad_y), norm_backward_reference,
        grad_y, x_hat, rstd, weight, centered,
    )  # fmt: skip
