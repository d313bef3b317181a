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
    fewbit_backward_reference,
    fewbit_forward_reference,
    pack_codes,
    packed_nbytes,
    unpack_codes,
)

__all__ = [
    "fewbit_backward",
    "fewbit_forward",
    "pack_codes",
    "packed_nbytes",
    "triton_available",
    "unpack_codes",
    "uses_triton",
]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on ``tensor`` run the Triton kernels."""
    return (
        tensor.is_cuda
        and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and os.environ.get("HF_ACTQ_DISABLE_TRITON", "0") in ("", "0")
        and triton_available()
    )


def fewbit_forward(x, activation, borders, bits, params=()):
    if uses_triton(x):
        from hf_actq.kernels.fewbit import fewbit_forward_triton

        return fewbit_forward_triton(x, activation, borders, bits, params)
    return fewbit_forward_reference(x, activation, borders, bits, params)


def fewbit_backward(grad_y, packed, levels, nan_flag, bits):
    if uses_triton(grad_y):
        from hf_actq.kernels.fewbit import fewbit_backward_triton

        return fewbit_backward_triton(grad_y, packed, levels, nan_flag, bits)
    return fewbit_backward_reference(grad_y, packed, levels, nan_flag, bits)
