"""Sign-preserving quantization (``codecs/sign_preserving.py``): ``hf_actq::blpa_quantize`` (block
absmax, step, ceil-based codes, bit packing) and ``hf_actq::blpa_dequantize``, each a PyTorch twin
and a Triton kernel. Deterministic, so the kernels' packed codes equal the twins' bit for bit.
"""

from __future__ import annotations

import math

import torch

from hf_actq.kernels.packing import (
    CODEC_CHUNK,
    Layout,
    one_allocation,
    pack_chunk_into,
    packed_nbytes,
    pad_to,
    unpack_codes,
)
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    TILE_ELEMENTS,
    cdiv,
    jit,
    pack_tile,
    row_max,
    strided_rows,
    strided_rows_tile,
    tile,
    tl,
    to_dtype,
    unpack_tile,
)


def blpa_quantize_reference(
    source: torch.Tensor, bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and per-block fp32 steps of ``source``'s flat copy; ``x > 0`` maps to the
    upper half of the codes."""
    source = source.reshape(-1)
    n = source.numel()
    half = 2 ** (bits - 1)
    packed, steps = one_allocation(blpa_layout(n, bits, block), source.device)
    for start in range(0, n, CODEC_CHUNK):
        stop = min(n, start + CODEC_CHUNK)
        chunk = source[start:stop].float()
        rows = -(-chunk.numel() // block)
        step = pad_to(chunk.abs(), rows * block, 0.0).view(rows, block).amax(dim=1) / half
        steps[start // block : start // block + rows] = step
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        # ceil(x / step) - 1: x in (0, step] -> 0 (upper half); x = 0 -> -1 (lower half).
        rows_view = pad_to(chunk, rows * block, 0.0).view(rows, block)
        q = torch.ceil(rows_view * inv[:, None]).view(-1)[: stop - start]
        pack_chunk_into(q.sub_(1.0).clamp_(-half, half - 1).add_(half), bits, packed, start)
    return packed, steps


def blpa_dequantize_reference(
    data: torch.Tensor,
    steps: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    bits: int,
    block: int,
) -> torch.Tensor:
    n = math.prod(shape)
    middle = 2 ** (bits - 1) - 0.5
    codes = unpack_codes(data, n, bits)
    out = torch.empty(n, dtype=dtype, device=data.device)
    for start in range(0, n, CODEC_CHUNK):
        stop = min(n, start + CODEC_CHUNK)
        rows = -(-(stop - start) // block)
        b0 = start // block
        c = pad_to(codes[start:stop].float() - middle, rows * block, 0.0).view(rows, block)
        values = c * steps[b0 : b0 + rows, None]
        out[start:stop] = values.view(-1)[: stop - start].to(dtype)
    return out.view(shape)


def _rows_per_tile(block: int) -> int:
    return max(1, TILE_ELEMENTS // block)


@jit
def blpa_quantize_kernel(
    src_ptr,
    packed_ptr,
    steps_ptr,
    n_elements,
    n_bytes,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # ROWS blocks per program, constant bits and block.
    first, count, local = tile(n_elements, ROWS, BLOCK)
    x = tl.load(src_ptr + first + local, mask=local < count, other=0.0).to(tl.float32)
    blpa_quantize_span(x, first, count, packed_ptr, steps_ptr, n_bytes - first * BITS // 8,
                       BITS, BLOCK, ROWS)  # fmt: skip


@jit
def blpa_quantize_strided_kernel(
    src_ptr,
    packed_ptr,
    steps_ptr,
    n_bytes,
    n_heads,
    n_rows,
    stride_batch,
    stride_head,
    stride_row,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    # blpa_quantize_kernel on a transposed view (attention's q, k and v), read where it lies:
    # the codes and steps of its flat copy (aq_quantize_strided_kernel's way).
    SPAN: tl.constexpr = ROWS * BLOCK // WIDTH
    values, first_row, rows = strided_rows_tile(
        src_ptr, n_heads, n_rows, stride_batch, stride_head, stride_row, SPAN, WIDTH
    )
    first = first_row * WIDTH
    count = (rows * WIDTH).to(tl.int32)
    byte_limit = tl.minimum(n_bytes - first * BITS // 8, count * BITS // 8)
    blpa_quantize_span(tl.reshape(values, [ROWS, BLOCK]), first, count, packed_ptr, steps_ptr,
                       byte_limit, BITS, BLOCK, ROWS)  # fmt: skip


@jit
def blpa_quantize_span(
    x,
    first,
    count,
    packed_ptr,
    steps_ptr,
    byte_limit,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Quantize the ``count`` values ``x`` ([ROWS, BLOCK] fp32; past ``count``: 0) from value
    ``first`` on (a multiple of BLOCK, 8k values), storing at most ``byte_limit`` bytes of
    codes (a tile that ends before the tensor does must not zero its successor's codes)."""
    local = tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = local < count
    half = tl.full([ROWS], 1 << (BITS - 1), tl.float32)
    step = tl.math.div_rn(row_max(tl.abs(x)), half)
    inv = tl.where(step > 0, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), step), 0.0)
    # ceil(x / step) - 1: x in (0, step] -> 0 (upper half); x = 0 -> -1 (lower half).
    HALF: tl.constexpr = 1 << (BITS - 1)
    q = tl.minimum(tl.maximum(tl.ceil(x * inv[:, None]) - 1.0, -HALF), HALF - 1.0) + HALF
    code = tl.where(valid, q, 0.0).to(tl.int32)
    pack_tile(packed_ptr + first * BITS // 8, code, byte_limit, ROWS, BLOCK, BITS)
    row = tl.arange(0, ROWS)
    tl.store(steps_ptr + first // BLOCK + row, step, mask=row * BLOCK < count)


@jit
def blpa_dequantize_kernel(
    packed_ptr,
    steps_ptr,
    out_ptr,
    n_elements,
    n_bytes,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    first, count, local = tile(n_elements, ROWS, BLOCK)
    byte_start = first * BITS // 8
    code = unpack_tile(packed_ptr + byte_start, n_bytes - byte_start, ROWS, BLOCK, BITS)
    row = tl.arange(0, ROWS)
    step = tl.load(steps_ptr + first // BLOCK + row, mask=row * BLOCK < count, other=0.0)
    MIDDLE: tl.constexpr = (1 << (BITS - 1)) - 0.5
    value = (code.to(tl.float32) - MIDDLE) * step[:, None]
    tl.store(out_ptr + first + local, to_dtype(value, out_ptr.dtype.element_ty), mask=local < count)


def blpa_layout(n: int, bits: int, block: int) -> Layout:
    """Where ``(packed, steps)`` for ``n`` values lie in their one allocation (the twin's as the
    kernel's): the steps lead the packed codes."""
    blocks = cdiv(n, block)
    return ((4 * blocks, packed_nbytes(n, bits), torch.uint8), (0, blocks, torch.float32))


def blpa_quantize_triton(source, bits, block):
    """The Triton side of :func:`blpa_quantize_reference`: one launch, one allocation. A
    transposed view (attention's q, k and v) is read where it lies, not copied first."""
    n = source.numel()
    packed, steps = one_allocation(blpa_layout(n, bits, block), source.device)
    if n == 0:
        return packed, steps
    layout = None if source.is_contiguous() else strided_rows(source, 1, block)
    rows = _rows_per_tile(block)
    constants = dict(BITS=bits, BLOCK=block, ROWS=rows, **LAUNCH_OPTIONS)
    if layout is not None:
        (batch, heads, n_rows, width), strides = layout
        blpa_quantize_strided_kernel[(cdiv(n_rows, rows * block // width), heads, batch)](
            source, packed, steps, packed.numel(), heads, n_rows, *strides, WIDTH=width,
            **constants,
        )  # fmt: skip
    else:
        blpa_quantize_kernel[(cdiv(n, rows * block),)](
            source.contiguous(), packed, steps, n, packed.numel(), **constants
        )
    return packed, steps


def blpa_dequantize_triton(data, steps, shape, dtype, bits, block):
    """The Triton side of :func:`blpa_dequantize_reference`: one launch, one allocation."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=steps.device)
    if n:
        rows = _rows_per_tile(block)
        blpa_dequantize_kernel[(cdiv(n, rows * block),)](
            data, steps, out, n, data.numel(), BITS=bits, BLOCK=block, ROWS=rows, **LAUNCH_OPTIONS
        )
    return out.view(shape)


blpa_quantize = register(
    "blpa_quantize",
    blpa_quantize_reference,
    blpa_quantize_triton,
    fake=lambda source, bits, block: (
        source.new_empty(packed_nbytes(source.numel(), bits), dtype=torch.uint8),
        source.new_empty(-(-source.numel() // block), dtype=torch.float32),
    ),
    takes=lambda source, bits, block: source.dtype in FLOATS,
)
blpa_dequantize = register(
    "blpa_dequantize",
    blpa_dequantize_reference,
    blpa_dequantize_triton,
    fake=lambda data, steps, shape, dtype, bits, block: data.new_empty(shape, dtype=dtype),
    takes=lambda data, steps, shape, dtype, bits, block: dtype in FLOATS,
)
