"""Dropout regenerated from a seed (``ops/dropout.py``, ``mode="seed"``):
``hf_actq::seeded_dropout``. The Triton kernel draws each element's keep decision from Philox
keyed by the seed and the element's index (one call for 4 elements), so forward and backward draw
the same mask without materialising it; no random tensor and no mask is ever allocated. The twin
draws from torch's generator: the same mask law, not the same bits, so a tensor stays on one
device between its forward and backward, as it does.
"""

from __future__ import annotations

import torch

from hf_actq.kernels.packing import CHUNK_ELEMENTS
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    cdiv,
    jit,
    tl,
    to_dtype,
)

BLOCK = 1024


def dropout_keep_reference(shape, p: float, seed: int, device) -> torch.Tensor:
    """The dropout keep-mask a seed stands for, from torch's generator (regenerated identically
    in backward), drawn a chunk at a time so that no full-size fp32 random tensor exists."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    keep = torch.empty(shape, dtype=torch.bool, device=device)
    flat = keep.view(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, flat.numel() - start)
        flat[start : start + count] = torch.rand(count, device=device, generator=generator) >= p
    return keep


def seeded_dropout_reference(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Dropout of ``x`` with the mask ``seed`` stands for: ``x * keep / (1 - p)``."""
    return x * dropout_keep_reference(x.shape, p, seed, x.device) * (1.0 / (1.0 - p))


@jit(do_not_specialize=["seed"])
def seeded_dropout_kernel(x_ptr, out_ptr, n_elements, p, scale, seed, BLOCK: tl.constexpr):
    # One Philox call gives 4 uniforms: element e takes output e % 4 of counter e // 4, where a
    # call per element (tl.rand) spent about 100 integer instructions on each value, several
    # times the element's memory time. A [BLOCK // 8, 8] tile (two calls a row) keeps 8
    # contiguous values in a thread: 128-bit accesses in 16-bit dtypes too.
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    lane = tl.arange(0, 8)[None, :]
    offsets = rows[:, None] * 8 + lane
    valid = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    u0, u1, u2, u3 = tl.rand4x(seed, 2 * rows)
    u4, u5, u6, u7 = tl.rand4x(seed, 2 * rows + 1)
    u = tl.where(lane == 0, u0[:, None], u7[:, None])
    u = tl.where(lane == 1, u1[:, None], u)
    u = tl.where(lane == 2, u2[:, None], u)
    u = tl.where(lane == 3, u3[:, None], u)
    u = tl.where(lane == 4, u4[:, None], u)
    u = tl.where(lane == 5, u5[:, None], u)
    u = tl.where(lane == 6, u6[:, None], u)
    keep = (u >= p).to(tl.float32)
    # x * keep is exact; one rounding of (x * keep) * scale, as torch's fp32 opmath does (a
    # dropped inf or nan stays nan, as in torch).
    tl.store(out_ptr + offsets, to_dtype(x * keep * scale, out_ptr.dtype.element_ty), mask=valid)


def seeded_dropout_triton(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The Triton side of :func:`seeded_dropout_reference`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (cdiv(n, BLOCK),)
        seeded_dropout_kernel[grid](
            x, out, n, float(p), 1.0 / (1.0 - p), seed, BLOCK=BLOCK, **LAUNCH_OPTIONS
        )
    return out


seeded_dropout = register(
    "seeded_dropout",
    seeded_dropout_reference,
    seeded_dropout_triton,
    fake=lambda x, p, seed: torch.empty_like(x),
    takes=lambda x, p, seed: x.dtype in FLOATS,
)
