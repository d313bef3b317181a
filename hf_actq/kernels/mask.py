"""Triton kernels for 1-bit masks (``codecs/mask.py``). Twins: ``mask_pack_reference`` /
``mask_unpack_reference``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_actq.kernels.reference import packed_nbytes
from hf_actq.kernels.triton_common import LAUNCH_OPTIONS, load_codes, store_packed, to_dtype

GROUPS = 256
UNPACK_BLOCK = 2048


@triton.jit
def mask_pack_kernel(src_ptr, packed_ptr, n_elements, n_bytes, GROUPS: tl.constexpr):
    groups8 = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offsets = groups8[:, None] * 8 + tl.arange(0, 8)[None, :]
    valid = offsets < n_elements
    x = tl.load(src_ptr + offsets, mask=valid, other=0)
    store_packed(packed_ptr, groups8, (valid & (x != 0)).to(tl.uint32), 1, n_bytes)


@triton.jit
def mask_unpack_kernel(packed_ptr, out_ptr, n_elements, n_bytes, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    bit = load_codes(packed_ptr, offsets, mask, 1, n_bytes)
    tl.store(out_ptr + offsets, to_dtype(bit.to(tl.float32), out_ptr.dtype.element_ty), mask=mask)


def mask_pack_triton(source: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`hf_actq.kernels.reference.mask_pack_reference`."""
    source = source.contiguous()
    if source.dtype == torch.bool:
        source = source.view(torch.uint8)
    n = source.numel()
    packed = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8, device=source.device)
    if n:
        grid = (triton.cdiv(n, 8 * GROUPS),)
        mask_pack_kernel[grid](source, packed, n, packed.numel(), GROUPS=GROUPS, **LAUNCH_OPTIONS)
    return packed


def mask_unpack_triton(data: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Triton twin of :func:`hf_actq.kernels.reference.mask_unpack_reference`."""
    n = shape.numel()
    out = torch.empty(n, dtype=torch.uint8 if dtype == torch.bool else dtype, device=data.device)
    if n:
        grid = (triton.cdiv(n, UNPACK_BLOCK),)
        mask_unpack_kernel[grid](data, out, n, data.numel(), BLOCK=UNPACK_BLOCK, **LAUNCH_OPTIONS)
    return (out.view(torch.bool) if dtype == torch.bool else out).view(shape)
