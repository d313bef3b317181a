"""Triton kernel for dropout regenerated from a seed (``ops/dropout.py``, ``mode="seed"``): the
keep decision of each element comes from Triton's Philox stream keyed by the seed and the
element's index, so forward and backward draw the same mask without materialising it; no
random tensor and no mask is ever allocated. Twin: ``seeded_dropout_reference`` (torch's
generator: the same mask law, not the same bits, so a tensor stays on one device between its
forward and backward, as it does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_actq.kernels.triton_common import LAUNCH_OPTIONS, to_dtype

BLOCK = 1024


@triton.jit(do_not_specialize=["seed"])
def seeded_dropout_kernel(x_ptr, out_ptr, n_elements, p, scale, seed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    keep = (tl.rand(seed, offsets) >= p).to(tl.float32)
    # x * keep is exact; one rounding of (x * keep) * scale, as torch's fp32 opmath does (a
    # dropped inf or nan stays nan, as in torch).
    tl.store(out_ptr + offsets, to_dtype(x * keep * scale, out_ptr.dtype.element_ty), mask=valid)


def seeded_dropout_triton(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Triton twin of :func:`hf_actq.kernels.reference.seeded_dropout_reference`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        seeded_dropout_kernel[grid](
            x, out, n, float(p), 1.0 / (1.0 - p), seed, BLOCK=BLOCK, **LAUNCH_OPTIONS
        )
    return out
