"""Average quantization (``codecs/average.py``): ``hf_actq::aq_quantize`` (group means, per-block
min and scale, stochastic rounding, bit packing) and ``hf_actq::aq_dequantize`` (unpack, scale,
repeat over the group), each a PyTorch twin and a Triton kernel that does it in one pass.

Stochastic rounding adds the twin's counter hash of each mean's index keyed by the codec's seed
(drawn from torch's RNG), so ``torch.manual_seed`` and checkpointing's RNG replay reproduce codes,
and kernel and twin pack the same codes bit for bit, stochastic or not (group means aside: the
kernel sums a group as a tree, the twin in order, which can differ in the last fp32 bit).
"""

from __future__ import annotations

import functools
import math

import torch

from hf_actq.kernels.compiled import as_int32, mix_seed, run, uniform_noise, use_compiled
from hf_actq.kernels.packing import (
    CODEC_CHUNK,
    COMPILED_CHUNK,
    Layout,
    divided,
    one_allocation,
    pack_uint8_codes_into,
    packed_nbytes,
    unpack_codes,
)
from hf_actq.kernels.registry import FLOATS, register, seed_beside
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    TILE_ELEMENTS,
    cdiv,
    hashed_noise,
    jit,
    noise_stream_key,
    pack_tile,
    row_max,
    row_min,
    strided_rows,
    strided_rows_tile,
    tile,
    tile_at,
    tl,
    to_dtype,
    unpack_tile,
)


def aq_quantize_reference(
    source: torch.Tensor,
    group: int,
    bits: int,
    block: int,
    stochastic: bool,
    seed: int = 0,
    device_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the means of consecutive ``group``-element runs of ``source``, flattened.

    Returns packed ``bits``-bit codes and per-block fp32 minimums and scales. Means are fp32 sums
    in order, divided by ``group`` and rounded to ``source``'s dtype (as the Triton kernel does)
    before quantization; stochastic rounding adds :func:`uniform_noise` of each mean's index keyed
    by ``seed``, deterministic rounding is ``floor(q + 0.5)``. Codes past the last mean are zero.
    ``device_seed`` (one int64 on ``source``'s device), where given, is the seed instead: the
    kernel reads it from memory (a CUDA graph replays it fresh); the twin reads it on the host.
    """
    if device_seed is not None and stochastic:  # a host read, where a kernel reads memory
        seed = int(device_seed.item())
    source = source.reshape(-1)
    m = source.numel() // group
    packed, mins, scales = aq_buffers(m, bits, block, source.device)
    compiled = use_compiled(source)
    noise_key = torch.tensor(mix_seed(seed if stochastic else 0), dtype=torch.int32)
    key = (source.dtype, group, bits, stochastic)
    step = COMPILED_CHUNK if compiled else CODEC_CHUNK
    for start in range(0, m, step):
        count = min(step, m - start)
        rows = -(-count // block)
        chunk = source[start * group : (start + count) * group]
        if count < rows * block:  # the last block is partial: repeat the last mean's run
            repeat = chunk[-group:].repeat(rows * block - count)
            chunk = torch.cat([chunk, repeat])
        offset = torch.tensor(as_int32(start), dtype=torch.int32)
        rows_view = chunk.view(rows, block, group)
        codes, lo, scale = run(
            compiled, _aq_codes, key, rows_view, bits, noise_key, offset, group, stochastic
        )
        codes = codes.view(-1)
        codes[count:] = 0
        mins[start // block : start // block + rows] = lo
        scales[start // block : start // block + rows] = scale
        pack_uint8_codes_into(codes, bits, packed, start, compiled)
    return packed, mins, scales


def _aq_codes(rows, bits: int, noise_key, offset, group: int, stochastic: bool):
    """Codes (uint8 [R, block]) and fp32 minimum and scale per row of ``rows`` [R, block, group].
    One pass when compiled; the Triton kernel's arithmetic, step for step."""
    total = rows[..., 0].float()
    for k in range(1, group):  # in order, as the Triton kernel sums
        total = total + rows[..., k].float()
    means = divided(total, group).to(rows.dtype).float()
    top = float(2**bits - 1)
    lo, hi = means.amin(dim=1), means.amax(dim=1)
    # hi / top - lo / top rather than (hi - lo) / top, which overflows for huge ranges.
    scale = divided(hi, top) - divided(lo, top)
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)
    q = means * inv[:, None] - (lo * inv)[:, None]
    if stochastic:
        index = torch.arange(q.numel(), dtype=torch.int32, device=q.device).view(q.shape)
        q = q + uniform_noise(index + offset, noise_key)
    else:
        q = q + 0.5
    return q.floor().clamp(0.0, top).to(torch.uint8), lo, scale


def aq_dequantize_reference(
    data: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    bits: int,
    group: int,
    block: int,
) -> torch.Tensor:
    """The tensor of ``shape``: each dequantized mean repeated over its group along the last dim
    (the last group of a row may be partial)."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    last = shape[-1] if len(shape) else 1
    per_row = -(-last // group)
    m = (n // last) * per_row
    means = torch.empty(m, dtype=dtype, device=data.device)
    compiled = use_compiled(means)
    step = COMPILED_CHUNK if compiled else CODEC_CHUNK
    for start in range(0, m, step):
        count = min(step, m - start)
        rows = -(-count // block)
        b0, byte_start = start // block, start * bits // 8
        chunk = data[byte_start : byte_start + packed_nbytes(count, bits)]
        codes = torch.zeros(rows * block, dtype=torch.uint8, device=data.device)
        codes[:count] = unpack_codes(chunk, count, bits)
        lo, scale = mins[b0 : b0 + rows], scales[b0 : b0 + rows]
        values = run(compiled, _aq_values, (dtype,), codes.view(rows, block), lo, scale, dtype)
        means[start : start + count] = values.view(-1)[:count]
    if group == 1:
        return means.view(shape)
    rows = n // last
    repeated = means.view(rows, per_row, 1).expand(rows, per_row, group)
    return repeated.reshape(rows, per_row * group)[:, :last].reshape(shape)


def _aq_values(codes, lo, scale, dtype: torch.dtype):
    """``lo[r] + code * scale[r]`` in fp32, rounded to ``dtype``, for uint8 ``codes`` [R, block]."""
    return (codes.float() * scale[:, None] + lo[:, None]).to(dtype)


@functools.cache
def _rows_per_tile(block: int, group: int) -> int:
    """Blocks a program handles: :data:`TILE_ELEMENTS` source elements (one block at least)."""
    return max(1, TILE_ELEMENTS // (block * group))


@jit(do_not_specialize=["noise_key"])
def aq_quantize_kernel(
    src_ptr,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    n_means,
    n_bytes,
    noise_key,
    seed_ptr,
    STOCHASTIC: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # ROWS blocks of BLOCK means per program; bits, group and block are constants: shifts, no
    # divisions. Loaded as rows of BLOCK * GROUP elements (contiguous: vector loads, a row
    # within a warp).
    first, count, _ = tile(n_means, ROWS, BLOCK)
    element = tl.arange(0, ROWS)[:, None] * (BLOCK * GROUP) + tl.arange(0, BLOCK * GROUP)
    values = tl.load(src_ptr + first * GROUP + element, mask=element < count * GROUP, other=0.0)
    if STOCHASTIC:
        key = noise_stream_key(noise_key, seed_ptr, SEED_IN_MEMORY).to(tl.int32, bitcast=True)
    else:
        key = noise_key
    aq_quantize_tile(
        values.to(tl.float32),
        tl.program_id(0),
        packed_ptr,
        mins_ptr,
        scales_ptr,
        n_means,
        n_bytes,
        key,
        src_ptr.dtype.element_ty,
        STOCHASTIC,
        BITS,
        GROUP,
        BLOCK,
        ROWS,
    )


@jit(do_not_specialize=["noise_key"])
def aq_quantize_strided_kernel(
    src_ptr,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    n_bytes,
    noise_key,
    seed_ptr,
    n_heads,
    n_rows,
    stride_batch,
    stride_head,
    stride_row,
    STOCHASTIC: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    # aq_quantize_kernel on a [batch, heads, rows, WIDTH] view whose rows are contiguous but not
    # each other's neighbours (attention's q, k and v: transposed views): the codes, mins and
    # scales of its flat copy, without the copy. A program takes a tile's worth of one (batch,
    # head)'s consecutive rows (its rows hold whole blocks: the launcher checks).
    SPAN: tl.constexpr = ROWS * BLOCK * GROUP // WIDTH
    values, first_row, rows = strided_rows_tile(
        src_ptr, n_heads, n_rows, stride_batch, stride_head, stride_row, SPAN, WIDTH
    )
    values = tl.reshape(values, [ROWS, BLOCK * GROUP])
    first = first_row * (WIDTH // GROUP)
    count = (rows * (WIDTH // GROUP)).to(tl.int32)
    if STOCHASTIC:
        key = noise_stream_key(noise_key, seed_ptr, SEED_IN_MEMORY).to(tl.int32, bitcast=True)
    else:
        key = noise_key
    aq_quantize_span(
        values,
        first,
        count,
        packed_ptr,
        mins_ptr,
        scales_ptr,
        tl.minimum(n_bytes - first * BITS // 8, count * BITS // 8),
        key,
        src_ptr.dtype.element_ty,
        STOCHASTIC,
        BITS,
        GROUP,
        BLOCK,
        ROWS,
    )


@jit
def aq_quantize_tile(
    values,
    tile_index,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    n_means,
    n_bytes,
    noise_key,
    DTYPE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Quantize tile ``tile_index``'s ROWS blocks of BLOCK means: ``values`` ([ROWS, BLOCK *
    GROUP] fp32 holding DTYPE values) are the tensor's consecutive elements from the tile's
    first (past its end: anything finite). Stores the codes, mins and scales."""
    first, count, _ = tile_at(tile_index, n_means, ROWS, BLOCK)
    aq_quantize_span(
        values,
        first,
        count,
        packed_ptr,
        mins_ptr,
        scales_ptr,
        n_bytes - first * BITS // 8,
        noise_key,
        DTYPE,
        STOCHASTIC,
        BITS,
        GROUP,
        BLOCK,
        ROWS,
    )


@jit
def aq_quantize_span(
    values,
    first,
    count,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    byte_limit,
    noise_key,
    DTYPE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """:func:`aq_quantize_tile` of the ``count`` means from mean ``first`` on (a multiple of
    ROWS * BLOCK or, in the strided kernel, of BLOCK), storing at most ``byte_limit`` bytes of
    codes (a tile that ends before the tensor does must not zero its successor's codes)."""
    local = tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = local < count
    if GROUP == 1:
        mean = values
    else:
        # Each thread sums the runs it holds. Dividing by a power of two is exact; the mean is
        # rounded to the source dtype.
        mean = tl.sum(tl.reshape(values, [ROWS, BLOCK, GROUP]), axis=2) * (1.0 / GROUP)
        mean = to_dtype(mean, DTYPE).to(tl.float32)

    lo = row_min(tl.where(valid, mean, float("inf")))
    hi = row_max(tl.where(valid, mean, float("-inf")))
    top = tl.full([ROWS], (1 << BITS) - 1, tl.float32)
    # Per row, so IEEE divisions cost nothing: hi / top - lo / top as the twin computes it.
    scale = tl.math.div_rn(hi, top) - tl.math.div_rn(lo, top)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale), 0.0)
    q = mean * inv[:, None] - (lo * inv)[:, None]
    if STOCHASTIC:
        index = first.to(tl.uint32) + local.to(tl.uint32)  # the mean's index, mod 2**32
        q = q + hashed_noise(index, noise_key.to(tl.uint32, bitcast=True))
    else:
        q = q + 0.5
    q = tl.minimum(tl.maximum(tl.floor(q), 0.0), (1 << BITS) - 1)
    code = tl.where(valid, q, 0.0).to(tl.int32)
    byte_start = first * BITS // 8  # a span starts on a whole byte: it holds 8k means
    pack_tile(packed_ptr + byte_start, code, byte_limit, ROWS, BLOCK, BITS)
    row = tl.arange(0, ROWS)
    row_valid = row * BLOCK < count
    tl.store(mins_ptr + first // BLOCK + row, lo, mask=row_valid)
    tl.store(scales_ptr + first // BLOCK + row, scale, mask=row_valid)


@jit
def aq_values_tile(
    tile_index,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    n_means,
    n_bytes,
    DTYPE: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Tile ``tile_index``'s ROWS blocks of BLOCK means, dequantized and rounded to DTYPE, each
    repeated over its GROUP elements: ``[ROWS, BLOCK * GROUP]`` consecutive elements of the
    tensor (past its end: garbage for the caller to mask)."""
    first, count, local = tile_at(tile_index, n_means, ROWS, BLOCK)
    byte_start = first * BITS // 8
    code = unpack_tile(packed_ptr + byte_start, n_bytes - byte_start, ROWS, BLOCK, BITS)
    code = code.to(tl.float32)
    row = tl.arange(0, ROWS)
    row_valid = row * BLOCK < count
    lo = tl.load(mins_ptr + first // BLOCK + row, mask=row_valid, other=0.0)
    scale = tl.load(scales_ptr + first // BLOCK + row, mask=row_valid, other=0.0)
    value = to_dtype(code * scale[:, None] + lo[:, None], DTYPE)
    if GROUP == 1:
        return value
    else:
        repeated = tl.broadcast_to(value[:, :, None], [ROWS, BLOCK, GROUP])
        return tl.reshape(repeated, [ROWS, BLOCK * GROUP])


@jit
def aq_dequantize_kernel(
    packed_ptr,
    mins_ptr,
    scales_ptr,
    out_ptr,
    n_means,
    n_bytes,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Each mean written over its GROUP elements: the tensor's flat runs (a last dim that is a
    # multiple of the group, or group 1), as rows of BLOCK * GROUP contiguous elements (vector
    # stores).
    value = aq_values_tile(
        tl.program_id(0),
        packed_ptr,
        mins_ptr,
        scales_ptr,
        n_means,
        n_bytes,
        out_ptr.dtype.element_ty,
        BITS,
        GROUP,
        BLOCK,
        ROWS,
    )
    first, count, _ = tile(n_means, ROWS, BLOCK)
    element = tl.arange(0, ROWS)[:, None] * (BLOCK * GROUP) + tl.arange(0, BLOCK * GROUP)
    tl.store(out_ptr + first * GROUP + element, value, mask=element < count * GROUP)


def aq_layout(m: int, bits: int, block: int) -> Layout:
    """Where ``(packed, mins, scales)`` for ``m`` means lie in their one allocation: the
    minimums and scales lead the packed codes."""
    blocks = cdiv(m, block)
    return (
        (8 * blocks, packed_nbytes(m, bits), torch.uint8),
        (0, blocks, torch.float32),
        (4 * blocks, blocks, torch.float32),
    )


def aq_buffers(m: int, bits: int, block: int, device) -> tuple[torch.Tensor, ...]:
    """``(packed, mins, scales)`` for ``m`` means: views of one allocation (:func:`aq_layout`),
    the twin's as the kernel's."""
    return one_allocation(aq_layout(m, bits, block), device)


def aq_quantize_triton(source, group, bits, block, stochastic, seed=0, device_seed=None):
    """The Triton side of :func:`aq_quantize_reference`: one launch, one allocation. A
    transposed view (attention's q, k and v) is read where it lies, not copied first."""
    m = source.numel() // group
    packed, mins, scales = aq_buffers(m, bits, block, source.device)
    if m == 0:
        return packed, mins, scales
    layout = None if source.is_contiguous() else strided_rows(source, group, block)
    rows = _rows_per_tile(block, group)
    arguments = (
        mix_seed(seed) if stochastic and device_seed is None else 0,
        source if device_seed is None else device_seed,  # an unread pointer without one
    )
    constants = dict(
        STOCHASTIC=bool(stochastic),
        SEED_IN_MEMORY=bool(stochastic) and device_seed is not None,
        BITS=bits,
        GROUP=group,
        BLOCK=block,
        ROWS=rows,
        **LAUNCH_OPTIONS,
    )
    if layout is not None:
        (batch, heads, n_rows, width), strides = layout
        span = rows * block * group // width
        aq_quantize_strided_kernel[(cdiv(n_rows, span), heads, batch)](
            source, packed, mins, scales, packed.numel(), *arguments, heads, n_rows, *strides,
            WIDTH=width, **constants,
        )  # fmt: skip
    else:
        aq_quantize_kernel[(cdiv(m, rows * block),)](
            source.contiguous(), packed, mins, scales, m, packed.numel(), *arguments, **constants
        )
    return packed, mins, scales


def aq_dequantize_triton(data, mins, scales, shape, dtype, bits, group, block):
    """The Triton side of :func:`aq_dequantize_reference`: one launch, one allocation, where
    the last dim is a multiple of the group (partial groups: the means, then repeated)."""
    n = math.prod(shape)
    last = shape[-1] if len(shape) else 1
    if n == 0 or last % group == 0:
        out = torch.empty(n, dtype=dtype, device=mins.device)
        n_means, kernel_group = n // group, group
    else:
        n_means, kernel_group = (n // last) * -(-last // group), 1
        out = torch.empty(n_means, dtype=dtype, device=mins.device)
    if n:
        rows = _rows_per_tile(block, kernel_group)
        aq_dequantize_kernel[(cdiv(n_means, rows * block),)](
            data,
            mins,
            scales,
            out,
            n_means,
            data.numel(),
            BITS=bits,
            GROUP=kernel_group,
            BLOCK=block,
            ROWS=rows,
            **LAUNCH_OPTIONS,
        )
    if kernel_group == group:
        return out.view(shape)
    rows = n // last
    repeated = out.view(rows, -1, 1).expand(rows, -(-last // group), group)
    return repeated.reshape(rows, -1)[:, :last].reshape(shape)


def _aq_quantize_fake(source, group, bits, block, stochastic, seed=0, device_seed=None):
    means = source.numel() // group
    return (
        source.new_empty(packed_nbytes(means, bits), dtype=torch.uint8),
        source.new_empty(-(-means // block), dtype=torch.float32),
        source.new_empty(-(-means // block), dtype=torch.float32),
    )


aq_quantize = register(
    "aq_quantize",
    aq_quantize_reference,
    aq_quantize_triton,
    fake=_aq_quantize_fake,
    takes=lambda source, *args: source.dtype in FLOATS and seed_beside(source, *args[5:]),
)
aq_dequantize = register(
    "aq_dequantize",
    aq_dequantize_reference,
    aq_dequantize_triton,
    fake=lambda data, mins, scales, shape, dtype, *_: data.new_empty(shape, dtype=dtype),
    takes=lambda data, mins, scales, shape, dtype, *_: dtype in FLOATS,
)
