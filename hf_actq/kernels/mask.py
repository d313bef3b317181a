"""1-bit masks (``codecs/mask.py``): ``hf_actq::mask_pack`` and ``hf_actq::mask_unpack``, each a
PyTorch twin and a Triton kernel."""

from __future__ import annotations

import math

import torch

from hf_actq.kernels.packing import pack_codes, packed_nbytes, unpack_codes
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    TILE_ELEMENTS,
    cdiv,
    jit,
    pack_tile,
    tile,
    tl,
    to_dtype,
    unpack_tile,
)

ROWS = TILE_ELEMENTS // 256  # rows of 256 elements (32 bytes packed) a program handles
MASK_DTYPES = (torch.bool, torch.uint8, *FLOATS)  # what the kernels read and write


def mask_pack_reference(source: torch.Tensor) -> torch.Tensor:
    """``source != 0`` packed to 1 bit per element."""
    # `!= 0` on a bool tensor would first promote it to int64.
    return pack_codes(source if source.dtype == torch.bool else source != 0, 1)


def mask_unpack_reference(data: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return unpack_codes(data, math.prod(shape), 1).to(dtype).view(shape)


@jit
def mask_pack_kernel(src_ptr, packed_ptr, n_elements, n_bytes, ROWS: tl.constexpr):
    # ROWS x 256 elements a program, bytes packed in-thread.
    first, count, local = tile(n_elements, ROWS, 256)
    valid = local < count
    x = tl.load(src_ptr + first + local, mask=valid, other=0)
    code = (valid & (x != 0)).to(tl.int32)
    pack_tile(packed_ptr + first // 8, code, n_bytes - first // 8, ROWS, 256, 1)


@jit
def mask_unpack_kernel(packed_ptr, out_ptr, n_elements, n_bytes, ROWS: tl.constexpr):
    first, count, local = tile(n_elements, ROWS, 256)
    bit = unpack_tile(packed_ptr + first // 8, n_bytes - first // 8, ROWS, 256, 1)
    value = to_dtype(bit.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + first + local, value, mask=local < count)


def mask_pack_triton(source: torch.Tensor) -> torch.Tensor:
    """The Triton side of :func:`mask_pack_reference`."""
    source = source.contiguous()
    if source.dtype == torch.bool:
        source = source.view(torch.uint8)
    n = source.numel()
    packed = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8, device=source.device)
    if n:
        grid = (cdiv(n, TILE_ELEMENTS),)
        mask_pack_kernel[grid](source, packed, n, packed.numel(), ROWS=ROWS, **LAUNCH_OPTIONS)
    return packed


def mask_unpack_triton(data: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The Triton side of :func:`mask_unpack_reference`."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.uint8 if dtype == torch.bool else dtype, device=data.device)
    if n:
        grid = (cdiv(n, TILE_ELEMENTS),)
        mask_unpack_kernel[grid](data, out, n, data.numel(), ROWS=ROWS, **LAUNCH_OPTIONS)
    return (out.view(torch.bool) if dtype == torch.bool else out).view(shape)


mask_pack = register(
    "mask_pack",
    mask_pack_reference,
    mask_pack_triton,
    fake=lambda source: source.new_empty(packed_nbytes(source.numel(), 1), dtype=torch.uint8),
    takes=lambda source: source.dtype in MASK_DTYPES,
)
mask_unpack = register(
    "mask_unpack",
    mask_unpack_reference,
    mask_unpack_triton,
    fake=lambda data, shape, dtype: data.new_empty(shape, dtype=dtype),
    takes=lambda data, shape, dtype: dtype in MASK_DTYPES,
)
