"""Kernel dispatch, in one place: CUDA tensors with Triton importable run the Triton kernels,
everything else runs the PyTorch twins in ``reference.py``.

Set ``HF_ACTQ_DISABLE_TRITON=1`` to force the twins on GPU too (debugging, bisecting).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

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


def uses_triton(tensor: torch.Tensor, dtypes=_TRITON_DTYPES) -> bool:
    """Whether ops on ``tensor`` run the Triton kernels."""
    return (
        tensor.is_cuda
        and tensor.dtype in dtypes
        and os.environ.get("HF_ACTQ_DISABLE_TRITON", "0") in ("", "0")
        and triton_available()
    )


def fewbit_forward(x, activation, borders, bits, params=(), output=True):
    if not output:  # codes only: the op torch.compile traces as one node
        return (None, *torch.ops.hf_actq.fewbit_codes(x, activation, borders, bits, list(params)))
    return _fewbit_forward(x, activation, borders, bits, params, output)


def _fewbit_forward(x, activation, borders, bits, params, output):
    if uses_triton(x):
        from hf_actq.kernels.fewbit import fewbit_forward_triton

        return fewbit_forward_triton(x, activation, borders, bits, params, output)
    return fewbit_forward_reference(x, activation, borders, bits, params, output)


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
    if uses_triton(grad_y):
        from hf_actq.kernels.fewbit import fewbit_backward_triton

        return fewbit_backward_triton(grad_y, packed, levels, nan_flag, bits)
    return fewbit_backward_reference(grad_y, packed, levels, nan_flag, bits)


@fewbit_backward.register_fake
def _(grad_y, packed, levels, nan_flag, bits):
    return torch.empty_like(grad_y, memory_format=torch.contiguous_format)


def aq_quantize(source, group, bits, block, stochastic, seed=0):
    if uses_triton(source):
        from hf_actq.kernels.average_quant import aq_quantize_triton

        return aq_quantize_triton(source, group, bits, block, stochastic, seed)
    return aq_quantize_reference(source, group, bits, block, stochastic, seed)


def aq_dequantize(data, mins, scales, shape, dtype, bits, group, block):
    if uses_triton(mins) and dtype in _TRITON_DTYPES:
        from hf_actq.kernels.average_quant import aq_dequantize_triton

        return aq_dequantize_triton(data, mins, scales, shape, dtype, bits, group, block)
    return aq_dequantize_reference(data, mins, scales, shape, dtype, bits, group, block)


def blpa_quantize(source, bits, block):
    if uses_triton(source):
        from hf_actq.kernels.sign_preserving import blpa_quantize_triton

        return blpa_quantize_triton(source, bits, block)
    return blpa_quantize_reference(source, bits, block)


def blpa_dequantize(data, steps, shape, dtype, bits, block):
    if uses_triton(steps) and dtype in _TRITON_DTYPES:
        from hf_actq.kernels.sign_preserving import blpa_dequantize_triton

        return blpa_dequantize_triton(data, steps, shape, dtype, bits, block)
    return blpa_dequantize_reference(data, steps, shape, dtype, bits, block)


def mask_pack(source):
    if uses_triton(source, _MASK_TRITON_DTYPES):
        from hf_actq.kernels.mask import mask_pack_triton

        return mask_pack_triton(source)
    return mask_pack_reference(source)


def mask_unpack(data, shape, dtype):
    if uses_triton(data, (torch.uint8,)) and dtype in _MASK_TRITON_DTYPES:
        from hf_actq.kernels.mask import mask_unpack_triton

        return mask_unpack_triton(data, shape, dtype)
    return mask_unpack_reference(data, shape, dtype)


def smaq_quantize(source, stats, block, slots, stochastic, seed=0):
    if uses_triton(source):
        from hf_actq.kernels.smaq import smaq_quantize_triton

        return smaq_quantize_triton(source, stats, block, slots, stochastic, seed)
    return smaq_quantize_reference(source, stats, block, slots, stochastic, seed)


def smaq_dequantize(main, extension, stats, shape, dtype, block, slots):
    if uses_triton(stats) and dtype in _TRITON_DTYPES:
        from hf_actq.kernels.smaq import smaq_dequantize_triton

        return smaq_dequantize_triton(main, extension, stats, shape, dtype, block, slots)
    return smaq_dequantize_reference(main, extension, stats, shape, dtype, block, slots)


def seeded_dropout(x, p, seed):
    if uses_triton(x):
        from hf_actq.kernels.dropout import seeded_dropout_triton

        return seeded_dropout_triton(x, p, seed)
    return seeded_dropout_reference(x, p, seed)


def norm_backward(grad_y, x_hat, rstd, weight, centered):
    if uses_triton(grad_y):
        from hf_actq.kernels.norm import norm_backward_triton

        return norm_backward_triton(grad_y, x_hat, rstd, weight, centered)
    return norm_backward_reference(grad_y, x_hat, rstd, weight, centered)
