"""Triton helpers shared by the kernels, and Triton itself where it is installed.

Bit layout (as in ``packing.py``): code ``i`` of width ``b`` occupies bits ``[i*b, (i+1)*b)``
of a little-endian stream, so 8 codes fill ``b`` whole bytes.

Without Triton (a CPU install) the kernels are still defined, as plain functions that nothing
launches: each op file holds its twin and its kernel, and the twins must import everywhere.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # CUDA's math library, as PyTorch's kernels call
except ImportError:
    triton = tl = libdevice = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' grids: plain Python, where ``triton.cdiv`` (a
    constexpr function, callable from host code through the JIT's machinery) cost about 8 µs a
    call on the host, twice per pack."""
    return -(-a // b)


def jit(fn=None, **options):
    """``triton.jit``, or the function itself where Triton is not installed."""
    if triton is None:
        return fn if fn is not None else (lambda function: function)
    return triton.jit(fn, **options) if fn is not None else triton.jit(**options)


# Compile options of every launch: no FMA contraction, so a GPU rounds each product and sum as the
# twins and the interpreter do (codes and values must match them bit for bit). The kernels are
# memory-bound; fusion would buy nothing measurable. Divisions that decide codes or values use
# tl.math.div_rn: Triton's fp32 `/` is div.full.f32 (up to 2 ulp off) on NVIDIA GPUs.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Integer arguments that must stay runtime values: Triton turns an int argument equal to 1 into a
# compile-time constant, on which the kernels' `.to(...)` fails (bits=1, group=1), and each
# value would be its own compilation that ahead-of-time compilation never saw.


# Values a tile kernel handles per program: 32 a thread at 4 warps, loaded as 128-bit vectors
# (the review of the first GPU run: one 128-value block per program kept about 4 KiB in flight
# per SM where 25 KiB are needed to reach bandwidth).
TILE_ELEMENTS = 4096


@jit
def tile(n_elements, ROWS: tl.constexpr, COLS: tl.constexpr):
    """This program's tile of ``ROWS * COLS`` consecutive elements of ``n_elements``: the first
    (int64), how many of them exist (int32), and each one's int32 offset from the first
    (``[ROWS, COLS]``). Per-element arithmetic stays 32-bit at any tensor size."""
    return tile_at(tl.program_id(0), n_elements, ROWS, COLS)


@jit
def tile_at(index, n_elements, ROWS: tl.constexpr, COLS: tl.constexpr):
    """:func:`tile` of tile ``index``: a program that loops over several tiles."""
    first = index.to(tl.int64) * (ROWS * COLS)
    count = tl.minimum(n_elements - first, ROWS * COLS).to(tl.int32)
    local = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    return first, count, local


@jit
def pack_tile(
    packed_ptr, code, n_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr
):
    """Store ``code`` ([ROWS, COLS] int32 < 2**BITS, COLS a multiple of 8; the codes of
    ROWS * COLS consecutive elements) from ``packed_ptr`` on, its first ``n_bytes`` bytes.
    Packed inside each thread with constant shifts, rows kept apart (so the load's layout
    stays and no shared memory is needed): a power-of-two width packs whole bytes, contiguous
    (vector stores); another width packs each 8 codes into a 64-bit word and stores its BITS
    bytes."""
    if 8 % BITS == 0:
        PER_BYTE: tl.constexpr = 8 // BITS
        lane = tl.arange(0, PER_BYTE)
        fields = (
            tl.reshape(code, [ROWS, COLS // PER_BYTE, PER_BYTE]) << (lane * BITS)[None, None, :]
        )
        byte = tl.sum(fields, axis=2)
        index = tl.arange(0, ROWS)[:, None] * (COLS // PER_BYTE) + tl.arange(0, COLS // PER_BYTE)
        tl.store(packed_ptr + index, byte.to(tl.uint8), mask=index < n_bytes)
    else:
        lane = tl.arange(0, 8).to(tl.int64)
        fields = tl.reshape(code, [ROWS, COLS // 8, 8]).to(tl.int64) << (lane * BITS)[None, None, :]
        word = tl.sum(fields, axis=2)
        group = tl.arange(0, ROWS)[:, None] * (COLS // 8) + tl.arange(0, COLS // 8)[None, :]
        for j in tl.static_range(BITS):
            byte = ((word >> (8 * j)) & 0xFF).to(tl.uint8)
            tl.store(packed_ptr + group * BITS + j, byte, mask=group * BITS + j < n_bytes)


@jit
def unpack_tile(packed_ptr, n_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """The [ROWS, COLS] int32 codes :func:`pack_tile` stored from ``packed_ptr`` on (bytes at or
    past ``n_bytes`` read as zeros)."""
    if 8 % BITS == 0:
        PER_BYTE: tl.constexpr = 8 // BITS
        index = tl.arange(0, ROWS)[:, None] * (COLS // PER_BYTE) + tl.arange(0, COLS // PER_BYTE)
        byte = tl.load(packed_ptr + index, mask=index < n_bytes, other=0).to(tl.int32)
        lane = tl.arange(0, PER_BYTE)
        code = (byte[:, :, None] >> (lane * BITS)[None, None, :]) & ((1 << BITS) - 1)
    else:
        group = tl.arange(0, ROWS)[:, None] * (COLS // 8) + tl.arange(0, COLS // 8)[None, :]
        word = tl.zeros([ROWS, COLS // 8], dtype=tl.int64)
        for j in tl.static_range(BITS):
            mask = group * BITS + j < n_bytes
            byte = tl.load(packed_ptr + group * BITS + j, mask=mask, other=0)
            word = word | (byte.to(tl.int64) << (8 * j))
        lane = tl.arange(0, 8).to(tl.int64)
        code = ((word[:, :, None] >> (lane * BITS)[None, None, :]) & ((1 << BITS) - 1)).to(tl.int32)
    return tl.reshape(code, [ROWS, COLS])


def strided_rows(source: torch.Tensor, group: int, block: int) -> tuple | None:
    """``(batch, heads, rows, width)`` and the first three's strides of a tensor that the
    strided pack kernels read where it lies (:func:`strided_rows_tile`, AQ's and BLPA's): at most
    4 dims (fewer: leading 1s), the last contiguous, a power of two in [8, TILE_ELEMENTS] wide,
    each (batch, head)'s rows holding whole blocks of ``block`` means of ``group`` values, the
    grid's limits kept. None for every other tensor (it is copied)."""
    if source.dim() < 2 or source.dim() > 4 or source.stride(-1) != 1:
        return None
    shape = (1,) * (4 - source.dim()) + tuple(source.shape)
    strides = (0,) * (4 - source.dim()) + tuple(source.stride())
    batch, heads, rows, width = shape
    if (
        width & (width - 1)
        or not 8 <= width <= TILE_ELEMENTS
        or (rows * width) % (block * group)
        or max(batch, heads) > 65535
    ):
        return None
    return shape, strides[:3]


@jit
def strided_rows_tile(
    src_ptr,
    n_heads,
    n_rows,
    stride_batch,
    stride_head,
    stride_row,
    SPAN: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """This program's SPAN rows of one (batch, head) of a [batch, heads, n_rows, WIDTH] view whose
    rows are contiguous but not each other's neighbours (attention's q, k and v: transposed
    views; program ids: row tile, head, batch): the values as fp32 [SPAN, WIDTH] (0 past the
    head's last row), the index of the first row in the view's flat copy (int64), and how many
    of the SPAN rows exist."""
    start = tl.program_id(0) * SPAN
    head, batch = tl.program_id(1), tl.program_id(2)
    row = start + tl.arange(0, SPAN)
    base = src_ptr + batch.to(tl.int64) * stride_batch + head.to(tl.int64) * stride_head
    offsets = row.to(tl.int64)[:, None] * stride_row + tl.arange(0, WIDTH)[None, :]
    values = tl.load(base + offsets, mask=(row < n_rows)[:, None], other=0.0)
    first_row = (batch.to(tl.int64) * n_heads + head) * n_rows + start
    return values.to(tl.float32), first_row, tl.minimum(n_rows - start, SPAN)


@jit
def _minimum_keeping_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _maximum_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def row_min(values):
    """The minimum of each row of ``values``, NaN where the row holds one, as torch's ``amin``:
    ``tl.min`` drops NaN (minNum on a GPU), and a block's NaN would then round to a finite code
    where the twin (and the stock model's saved tensor) keeps it non-finite."""
    return tl.reduce(values, 1, _minimum_keeping_nan)


@jit
def row_max(values):
    """:func:`row_min`'s maximum."""
    return tl.reduce(values, 1, _maximum_keeping_nan)


@jit
def hashed_noise(index, key):
    """``kernels/compiled.py:uniform_noise`` bit for bit: fp32 noise in [0, 1) with 24 random
    bits, the lowbias32 hash of uint32 ``index`` and uint32 ``key``. About 10 integer
    instructions a value where Philox takes about 100, and the twins draw the same noise."""
    h = index * 0x9E3779B1 + key
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216)


@jit
def noise_stream_key(noise_key, seed_ptr, SEED_IN_MEMORY: tl.constexpr):
    """The uint32 key :func:`hashed_noise` takes: the launch's int32 ``noise_key`` (the host's
    ``compiled.mix_seed`` of a host seed), or, with ``SEED_IN_MEMORY``, ``mix_seed`` of the
    int64 seed at ``seed_ptr``, computed here bit for bit. A seed read from memory is what a
    CUDA graph replays fresh each step (one given as an argument is frozen at capture)."""
    if SEED_IN_MEMORY:
        value = tl.load(seed_ptr).to(tl.uint64)
        value = value * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019
        value = (value ^ (value >> 29)) * 0xBF58476D1CE4E5B9
        return (value ^ (value >> 32)).to(tl.uint32)
    else:
        return noise_key.to(tl.uint32, bitcast=True)


@jit
def store_packed(packed_ptr, group, code, bits, n_bytes):
    """Store ``code`` ([G, 8] integers < 2**bits, bits <= 8) of 8-element groups ``group``."""
    lane = tl.arange(0, 8)
    word = tl.sum(code.to(tl.uint64) << (lane[None, :] * bits).to(tl.uint64), axis=1)
    byte_offsets = group[:, None] * bits + lane[None, :]
    values = (word[:, None] >> (lane[None, :] * 8).to(tl.uint64)) & 0xFF
    byte_mask = (lane[None, :] < bits) & (byte_offsets < n_bytes)
    tl.store(packed_ptr + byte_offsets, values.to(tl.uint8), mask=byte_mask)


@jit
def load_codes(packed_ptr, offsets, mask, bits, n_bytes):
    """The codes of elements ``offsets`` (int64); a code can straddle two bytes."""
    bit_pos = offsets * bits
    byte_pos = bit_pos >> 3
    shift = (bit_pos & 7).to(tl.int32)
    low = tl.load(packed_ptr + byte_pos, mask=mask, other=0).to(tl.int32)
    straddles = mask & (shift + bits > 8) & (byte_pos + 1 < n_bytes)
    high = tl.load(packed_ptr + byte_pos + 1, mask=straddles, other=0).to(tl.int32)
    return ((low | (high << 8)) >> shift) & ((1 << bits) - 1)


@jit
def rows_and_columns(first, local, width, inv_width):
    """The row (int64) and column (int32) of elements ``first + local`` of a ``[rows, width]``
    tensor, by float reciprocals corrected by one step (no integer division: a 64-bit one is a
    subroutine of about 80 instructions an element). ``local`` < 2**23 - width."""
    # floor(first / width) in fp64 is exact below 2**53 (a quotient just under an integer k is
    # 1 / width below it, far more than an ulp); the check below guards it anyway.
    first_row = tl.floor(first.to(tl.float64) / width).to(tl.int64)
    start = first - first_row * width
    first_row += (start >= width).to(tl.int64) - (start < 0).to(tl.int64)
    start = (first - first_row * width).to(tl.int32)
    column = start + local  # exact in fp32 below 2**24
    row = (column.to(tl.float32) * inv_width).to(tl.int32)
    row = tl.where(row * width > column, row - 1, row)
    row = tl.where((row + 1) * width <= column, row + 1, row)
    return first_row + row, column - row * width


@jit
def to_dtype(v, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even.

    bf16 is rounded by hand because the Triton interpreter's fp32 -> bf16 cast truncates, and the
    kernels must round identically under the interpreter (where the tests run) and on a GPU.
    """
    if tl.bfloat16 == DTYPE:
        raw = v.to(tl.uint32, bitcast=True)
        rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)  # keep NaN a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)
