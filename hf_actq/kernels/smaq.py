"""SmaQ (``codecs/smaq.py``): ``hf_actq::smaq_quantize`` (the tensor's mean and standard
deviation, one read of it; then z-scores, rounding, 6-bit main codes and per-block 2-bit extension
slots filled in element order by a block-local cumsum, all into one allocation) and
``hf_actq::smaq_dequantize``, each a PyTorch twin and Triton kernels. Given the same statistics,
the codes and values are bit-exact with their twins, stochastic rounding included (the noise is
the hash the AQ kernels draw, ``kernels/compiled.py:uniform_noise``); the statistics agree to
fp32 rounding (the kernel sums a tile as a tree, the twin as PyTorch does). Attention's
transposed q, k and v are read where they lie when each head holds whole statistics tiles.
"""

from __future__ import annotations

import math

import torch

from hf_actq.kernels.compiled import as_int32, mix_seed, uniform_noise
from hf_actq.kernels.packing import (
    Layout,
    divided,
    one_allocation,
    pack_chunk_into,
    pack_codes,
    packed_nbytes,
    pad_to,
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
    strided_rows,
    strided_rows_tile,
    tile,
    tl,
    to_dtype,
    unpack_tile,
)

CHUNK_BLOCKS = 256
# Rows of TILE_ELEMENTS values the statistics twin reduces at a time (1 Mi values: a few fp32
# transients of 4 MiB), and the statistics kernel's tile: 32 rows of 128 values (32 a thread at
# 4 warps, 128-bit loads).
STATS_CHUNK_TILES = 256
STATS_ROWS, STATS_COLS = 32, TILE_ELEMENTS // 32
# Tiles' partials the combining program reads at a time (16 Mi values are 4,096 tiles).
COMBINE_CHUNK = 1024
# Values a quantize or dequantize program handles: whole blocks, 16 a thread at 4 warps. At 32 a
# thread, as the AQ kernels take, the quantize kernel held 154-229 registers a thread (sm_90: two
# programs an SM at most); at 16, 80-145.
CODE_TILE_ELEMENTS = 2048


def smaq_stats_reference(source: torch.Tensor) -> torch.Tensor:
    """fp32 ``[mean, std]`` (population) of flat ``source``: per tile of
    :data:`TILE_ELEMENTS` values, fp32 sums of ``x - k`` and ``(x - k)**2`` about the tile's
    first value ``k`` (no cancellation against a large mean), combined in fp64 by
    :func:`combined_stats`, as the kernel does."""
    n = source.numel()
    tiles = cdiv(n, TILE_ELEMENTS)
    partials = torch.empty(3, tiles, dtype=torch.float32, device=source.device)
    step = STATS_CHUNK_TILES * TILE_ELEMENTS
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = cdiv(stop - start, TILE_ELEMENTS)
        chunk = pad_to(source[start:stop].float(), rows * TILE_ELEMENTS, 0.0)
        chunk = chunk.view(rows, TILE_ELEMENTS)
        valid = torch.arange(rows * TILE_ELEMENTS, device=source.device) < stop - start
        shift = chunk[:, 0]
        deviation = torch.where(valid.view(rows, -1), chunk - shift[:, None], 0.0)
        first = start // TILE_ELEMENTS
        partials[0, first : first + rows] = deviation.sum(dim=1)
        partials[1, first : first + rows] = (deviation * deviation).sum(dim=1)
        partials[2, first : first + rows] = shift
    return combined_stats(partials, n)


def combined_stats(partials: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 ``[mean, std]`` from per-tile ``[sum(x - k), sum((x - k)**2), k]`` (Chan et al.'s
    pairwise combination, in fp64; every tile holds TILE_ELEMENTS values but the last)."""
    if n == 0:
        return torch.zeros(2, dtype=torch.float32, device=partials.device)
    sums, squares, shifts = partials.double()
    counts = torch.full_like(sums, TILE_ELEMENTS)
    counts[-1] = n - (sums.numel() - 1) * TILE_ELEMENTS
    tile_means = shifts + sums / counts
    spread = (squares - sums * sums / counts).clamp_min(0.0)  # each tile's sum of squares
    mean = (counts * tile_means).sum() / n
    spread = spread.sum() + (counts * (tile_means - mean) ** 2).sum()
    return torch.stack([mean, (spread / n).sqrt()]).float()


def smaq_layout(n: int, block: int, slots: int) -> Layout:
    """Where ``(main, extension, stats)`` of ``n`` values lie in their one allocation: the fp32
    statistics lead, then the extension slots, then the 6-bit main codes."""
    extension = cdiv(n, block) * slots // 4
    return ((8 + extension, packed_nbytes(n, 6), torch.uint8), (8, extension, torch.uint8),
            (0, 2, torch.float32))  # fmt: skip


def smaq_quantize_reference(
    source: torch.Tensor,
    block: int,
    slots: int,
    stochastic: bool,
    seed: int = 0,
    device_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(main, extension, stats)`` of ``source``'s flat copy, views of one allocation
    (:func:`smaq_layout`): its fp32 ``[mean, std]`` (:func:`smaq_stats_reference`), then the
    codes given them (:func:`smaq_codes_reference`)."""
    flat = source.reshape(-1)
    stats = smaq_stats_reference(flat)
    main, extension = smaq_codes_reference(flat, stats, block, slots, stochastic, seed, device_seed)
    buffers = one_allocation(smaq_layout(flat.numel(), block, slots), source.device)
    for buffer, value in zip(buffers, (main, extension, stats)):
        buffer.copy_(value)
    return buffers


def smaq_codes_reference(
    source: torch.Tensor,
    stats: torch.Tensor,
    block: int,
    slots: int,
    stochastic: bool,
    seed: int = 0,
    device_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed 6-bit main codes and packed 2-bit extension slots (``slots`` per block) of flat
    ``source`` given its fp32 ``[mean, std]``; see ``codecs/smaq.py`` for the layout. Stochastic
    rounding adds :func:`uniform_noise` of each element's index keyed by ``seed``, deterministic
    rounding adds 0.5 before the floor. ``device_seed`` (one int64 on ``source``'s device), where
    given, is the seed instead: the kernel reads it from memory (a CUDA graph replays it fresh);
    the twin reads it on the host."""
    if device_seed is not None and stochastic:  # a host read, where a kernel reads memory
        seed = int(device_seed.item())
    n = source.numel()
    device = source.device
    mean, std = stats[0], stats[1]
    inv_std = torch.where(std > 0, 1.0 / std, torch.zeros_like(std))
    noise_key = torch.tensor(mix_seed(seed), dtype=torch.int32)  # 0-dim: a scalar on any device
    blocks = -(-n // block)
    main = torch.empty(packed_nbytes(n, 6), dtype=torch.uint8, device=device)
    extension = torch.zeros(blocks, max(slots, 1), dtype=torch.float32, device=device)
    step = CHUNK_BLOCKS * block
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = -(-(stop - start) // block)
        chunk = pad_to(source[start:stop].float(), rows * block, 0.0)
        z = ((chunk - mean) * inv_std).clamp_(-2.0, 2.0).view(rows, block)
        if stochastic:
            index = torch.arange(rows * block, dtype=torch.int32, device=device) + as_int32(start)
            u = uniform_noise(index, noise_key).view(z.shape)
        else:
            u = torch.full_like(z, 0.5)
        valid = (torch.arange(rows * block, device=device) < stop - start).view(rows, block)
        outlier = (z.abs() > 1.0) & valid
        inlier_code = torch.floor((z + 1.0) * 15.5 + u).clamp_(0, 31)
        magnitude = z.abs() - 1.0
        fine = torch.floor(magnitude * 63.0 + u).clamp_(0, 63)
        coarse = torch.floor(magnitude * 15.0 + u).clamp_(0, 15)
        rank = torch.cumsum(outlier.to(torch.int32), dim=1) - 1
        extended = outlier & (rank < slots)
        top = torch.where(extended, torch.floor(fine / 4), coarse)
        code = torch.where(outlier, 32 + 16 * (z < 0).float() + top, inlier_code)
        pack_chunk_into(code.view(-1)[: stop - start], 6, main, start)
        if slots:
            low = fine - 4 * torch.floor(fine / 4)
            ext = extension[start // block : start // block + rows]
            row_index = torch.arange(rows, device=device)[:, None].expand_as(rank)
            ext[row_index[extended], rank[extended].long()] = low[extended]
    if not slots:
        return main, main.new_empty(0)
    return main, pack_codes(extension[:, :slots].reshape(-1), 2)


def smaq_dequantize_reference(
    main: torch.Tensor,
    extension: torch.Tensor,
    stats: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    block: int,
    slots: int,
) -> torch.Tensor:
    n = math.prod(shape)
    device = main.device
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    blocks = -(-n // block)
    codes = torch.zeros(blocks * block, dtype=torch.int32, device=device)
    codes[:n] = unpack_codes(main, n, 6).to(torch.int32)
    codes = codes.view(blocks, block)
    outlier = codes >= 32
    top = (codes & 15).float()
    rank = torch.cumsum(outlier.to(torch.int32), dim=1) - 1
    extended = outlier & (rank < slots)
    magnitude = divided(top, 15.0)
    if slots:
        ext = unpack_codes(extension, blocks * slots, 2).view(blocks, slots).float()
        low = ext.gather(1, rank.clamp(0, slots - 1).to(torch.int64))
        magnitude = torch.where(extended, divided(4 * top + low, 63.0), magnitude)
    sign = torch.where((codes & 16) > 0, -1.0, 1.0)
    z = torch.where(outlier, sign * (1.0 + magnitude), divided(codes.float(), 15.5) - 1.0)
    values = z.view(-1)[:n] * stats[1] + stats[0]
    return values.to(dtype).view(shape)


@jit
def smaq_stats_kernel(
    src_ptr, partials_ptr, n_elements, n_tiles, ROWS: tl.constexpr, COLS: tl.constexpr
):
    # One tile of ROWS * COLS values a program (128-bit loads); the sums about the tile's first
    # value, as the twin takes them.
    first, count, local = tile(n_elements, ROWS, COLS)
    valid = local < count
    x = tl.load(src_ptr + first + local, mask=valid, other=0.0).to(tl.float32)
    shift = tl.load(src_ptr + first).to(tl.float32)
    store_tile_partials(x, valid, shift, tl.program_id(0), partials_ptr, n_tiles)


@jit
def smaq_stats_strided_kernel(
    src_ptr,
    partials_ptr,
    n_tiles,
    n_heads,
    n_rows,
    stride_batch,
    stride_head,
    stride_row,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    # A transposed q, k or v where it lies (strided_rows_tile), each head's values whole tiles:
    # the flat copy's tile, the same values in the same order.
    values, first_row, _ = strided_rows_tile(
        src_ptr, n_heads, n_rows, stride_batch, stride_head, stride_row, ROWS * COLS // WIDTH, WIDTH
    )
    x = tl.reshape(values, [ROWS, COLS])
    base = src_ptr + tl.program_id(2).to(tl.int64) * stride_batch
    start = tl.program_id(0).to(tl.int64) * (ROWS * COLS // WIDTH)
    shift = tl.load(base + tl.program_id(1).to(tl.int64) * stride_head + start * stride_row)
    valid = tl.full([ROWS, COLS], 1, tl.int1)
    tile_index = first_row * WIDTH // (ROWS * COLS)
    store_tile_partials(x, valid, shift.to(tl.float32), tile_index, partials_ptr, n_tiles)


@jit
def store_tile_partials(x, valid, shift, tile_index, partials_ptr, n_tiles):
    """A tile's ``[sum(x - k), sum((x - k)**2), k]`` into column ``tile_index`` of the
    partials."""
    deviation = tl.where(valid, x - shift, 0.0)
    tl.store(partials_ptr + tile_index, tl.sum(tl.sum(deviation, axis=1), axis=0))
    squares = tl.sum(tl.sum(deviation * deviation, axis=1), axis=0)
    tl.store(partials_ptr + n_tiles + tile_index, squares)
    tl.store(partials_ptr + 2 * n_tiles + tile_index, shift)


@jit
def smaq_combine_kernel(
    partials_ptr, stats_ptr, n_elements, n_tiles, TILE: tl.constexpr, CHUNK: tl.constexpr
):
    # One program: combined_stats's arithmetic, in fp64, CHUNK tiles' partials at a time (the
    # sums in another order than the twin's; its dozen small launches made one).
    index = tl.arange(0, CHUNK)
    last_count = (n_elements - (n_tiles - 1) * TILE).to(tl.float64)
    weighted = tl.zeros([CHUNK], dtype=tl.float64)
    for start in range(0, n_tiles, CHUNK):
        tile_index = start + index
        valid = tile_index < n_tiles
        sums = tl.load(partials_ptr + tile_index, mask=valid, other=0.0).to(tl.float64)
        shifts = tl.load(partials_ptr + 2 * n_tiles + tile_index, mask=valid, other=0.0)
        counts = tl.where(tile_index == n_tiles - 1, last_count, TILE * 1.0)
        tile_means = shifts.to(tl.float64) + sums / counts
        weighted += tl.where(valid, counts * tile_means, 0.0)
    mean = tl.sum(weighted, axis=0) / n_elements.to(tl.float64)
    spread = tl.zeros([CHUNK], dtype=tl.float64)
    for start in range(0, n_tiles, CHUNK):
        tile_index = start + index
        valid = tile_index < n_tiles
        sums = tl.load(partials_ptr + tile_index, mask=valid, other=0.0).to(tl.float64)
        squares = tl.load(partials_ptr + n_tiles + tile_index, mask=valid, other=0.0)
        shifts = tl.load(partials_ptr + 2 * n_tiles + tile_index, mask=valid, other=0.0)
        counts = tl.where(tile_index == n_tiles - 1, last_count, TILE * 1.0)
        tile_means = shifts.to(tl.float64) + sums / counts
        within = squares.to(tl.float64) - sums * sums / counts
        within = tl.where(within < 0.0, 0.0, within)  # clamped, a NaN kept
        between = counts * (tile_means - mean) * (tile_means - mean)
        spread += tl.where(valid, within + between, 0.0)
    std = tl.sqrt(tl.sum(spread, axis=0) / n_elements.to(tl.float64))
    tl.store(stats_ptr, mean.to(tl.float32))
    tl.store(stats_ptr + 1, std.to(tl.float32))


@jit
def _segment_sum(left, right):
    # Sums restarted at each flagged value: bit 16 flags a segment's first value, the low bits
    # hold sums (at most 255: one extension byte). Associative, so a scan can take it.
    return tl.where((right >> 16) != 0, right, left + right)


@jit(do_not_specialize=["slots", "noise_key"])
def smaq_quantize_kernel(
    src_ptr,
    stats_ptr,
    main_ptr,
    ext_ptr,
    n_elements,
    n_main_bytes,
    slots,
    noise_key,
    seed_ptr,
    STOCHASTIC: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES_PAD: tl.constexpr,
):
    # ROWS blocks of BLOCK values a program, a block a row (128-bit loads; a row's cumsum stays
    # within a warp).
    first, count, local = tile(n_elements, ROWS, BLOCK)
    x = tl.load(src_ptr + first + local, mask=local < count, other=0.0).to(tl.float32)
    smaq_quantize_span(x, first, count, stats_ptr, main_ptr, ext_ptr, n_main_bytes, slots,
                       noise_key, seed_ptr, STOCHASTIC, SEED_IN_MEMORY, BLOCK, ROWS,
                       BYTES_PAD)  # fmt: skip


@jit(do_not_specialize=["slots", "noise_key"])
def smaq_quantize_strided_kernel(
    src_ptr,
    stats_ptr,
    main_ptr,
    ext_ptr,
    n_main_bytes,
    slots,
    noise_key,
    seed_ptr,
    n_heads,
    n_rows,
    stride_batch,
    stride_head,
    stride_row,
    STOCHASTIC: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES_PAD: tl.constexpr,
    WIDTH: tl.constexpr,
):
    # A transposed q, k or v where it lies (strided_rows_tile), each head's values whole tiles:
    # the flat copy's tile, its codes and slots.
    values, first_row, rows = strided_rows_tile(
        src_ptr, n_heads, n_rows, stride_batch, stride_head, stride_row, ROWS * BLOCK // WIDTH,
        WIDTH,
    )  # fmt: skip
    x = tl.reshape(values, [ROWS, BLOCK])
    smaq_quantize_span(x, first_row * WIDTH, (rows * WIDTH).to(tl.int32), stats_ptr, main_ptr,
                       ext_ptr, n_main_bytes, slots, noise_key, seed_ptr, STOCHASTIC,
                       SEED_IN_MEMORY, BLOCK, ROWS, BYTES_PAD)  # fmt: skip


@jit
def smaq_quantize_span(
    x,
    first,
    count,
    stats_ptr,
    main_ptr,
    ext_ptr,
    n_main_bytes,
    slots,
    noise_key,
    seed_ptr,
    STOCHASTIC: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES_PAD: tl.constexpr,
):
    """Codes and extension slots of the ``count`` values ``x`` ([ROWS, BLOCK] fp32, a block a
    row) from value ``first`` on (a multiple of BLOCK)."""
    local = tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = local < count
    mean = tl.load(stats_ptr)
    std = tl.load(stats_ptr + 1)
    inv_std = tl.where(std > 0, tl.math.div_rn(1.0, std), 0.0)
    z = tl.minimum(tl.maximum((x - mean) * inv_std, -2.0), 2.0)
    if STOCHASTIC:
        key = noise_stream_key(noise_key, seed_ptr, SEED_IN_MEMORY)
        u = hashed_noise(first.to(tl.uint32) + local.to(tl.uint32), key)  # index mod 2**32
    else:
        u = tl.full([ROWS, BLOCK], 0.5, tl.float32)
    outlier = (tl.abs(z) > 1.0) & valid
    inlier_code = tl.minimum(tl.maximum(tl.floor((z + 1.0) * 15.5 + u), 0.0), 31.0)
    magnitude = tl.abs(z) - 1.0
    fine = tl.minimum(tl.maximum(tl.floor(magnitude * 63.0 + u), 0.0), 63.0).to(tl.int32)
    coarse = tl.minimum(tl.maximum(tl.floor(magnitude * 15.0 + u), 0.0), 15.0).to(tl.int32)
    rank = tl.cumsum(outlier.to(tl.int32), axis=1) - 1
    extended = outlier & (rank < slots)
    top = tl.where(extended, fine >> 2, coarse)
    code = tl.where(outlier, 32 + tl.where(z < 0, 16, 0) + top, inlier_code.to(tl.int32))
    byte_start = first * 6 // 8  # a tile starts on a whole byte: it holds 8k values
    code = tl.where(valid, code, 0)
    pack_tile(main_ptr + byte_start, code, n_main_bytes - byte_start, ROWS, BLOCK, 6)

    # Slot j of a block holds the low 2 magnitude bits of its outlier of rank j, at bits
    # 2 (j % 4) of byte j // 4: a scan sums each 4 ranks' fields (disjoint: the sum is their OR)
    # and the last of them stores the byte; bytes no outlier reaches store 0. Every byte is
    # stored once.
    field = tl.where(extended, (fine & 3) << ((rank & 3) * 2), 0)
    starts = extended & ((rank & 3) == 0)
    byte = tl.associative_scan(field | (starts.to(tl.int32) << 16), 1, _segment_sum) & 0xFF
    used = tl.minimum(tl.sum(outlier.to(tl.int32), axis=1), slots)  # filled slots a block
    last = extended & (((rank & 3) == 3) | (rank == used[:, None] - 1))
    row = tl.arange(0, ROWS)
    row_bytes = ext_ptr + (first // BLOCK + row)[:, None] * (slots >> 2)
    tl.store(row_bytes + (rank >> 2), byte.to(tl.uint8), mask=last)
    index = tl.arange(0, BYTES_PAD)[None, :]
    empty = (index < (slots >> 2)) & (4 * index >= used[:, None]) & (row * BLOCK < count)[:, None]
    tl.store(row_bytes + index, tl.zeros([ROWS, BYTES_PAD], tl.uint8), mask=empty)


@jit(do_not_specialize=["slots"])
def smaq_dequantize_kernel(
    main_ptr,
    ext_ptr,
    stats_ptr,
    out_ptr,
    n_elements,
    n_main_bytes,
    slots,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    first, count, local = tile(n_elements, ROWS, BLOCK)
    valid = local < count
    byte_start = first * 6 // 8
    code = unpack_tile(main_ptr + byte_start, n_main_bytes - byte_start, ROWS, BLOCK, 6)
    outlier = (code >= 32) & valid
    top = code & 15
    rank = tl.cumsum(outlier.to(tl.int32), axis=1) - 1
    extended = outlier & (rank < slots)
    row_bytes = ext_ptr + (first // BLOCK + tl.arange(0, ROWS))[:, None] * (slots >> 2)
    byte = tl.load(row_bytes + (rank >> 2), mask=extended, other=0).to(tl.int32)
    low = (byte >> ((rank & 3) * 2)) & 3
    # One IEEE division an element, of the numerator and divisor its kind of code takes (the
    # twin's three divisions, each rounded once).
    numerator = tl.where(extended, 4 * top + low, tl.where(outlier, top, code)).to(tl.float32)
    divisor = tl.where(extended, 63.0, tl.where(outlier, 15.0, 15.5))
    quotient = tl.math.div_rn(numerator, divisor)
    sign = tl.where((code & 16) > 0, -1.0, 1.0)
    z = tl.where(outlier, sign * (1.0 + quotient), quotient - 1.0)
    value = z * tl.load(stats_ptr + 1) + tl.load(stats_ptr)
    tl.store(out_ptr + first + local, to_dtype(value, out_ptr.dtype.element_ty), mask=valid)


def extension_bytes_pad(slots: int) -> int:
    """The power of two at or above a block's extension bytes (``slots // 4``): the kernel's
    constexpr, so each capacity compiles its own small tile."""
    return 1 << (max(slots // 4, 1) - 1).bit_length()


def smaq_stats_triton(source, stats=None, layout=None):
    """The Triton side of :func:`smaq_stats_reference`: one read of ``source`` (where it lies,
    given its :func:`strided_rows` ``layout``), then one program combines the tiles' partials
    into ``stats`` (a new tensor unless given)."""
    n = source.numel()
    if stats is None:
        stats = torch.empty(2, dtype=torch.float32, device=source.device)
    if n == 0:
        return stats.zero_()
    tiles = cdiv(n, TILE_ELEMENTS)
    partials = torch.empty(3 * tiles, dtype=torch.float32, device=source.device)
    shape = dict(ROWS=STATS_ROWS, COLS=STATS_COLS, **LAUNCH_OPTIONS)
    if layout is not None:
        (batch, heads, n_rows, width), strides = layout
        smaq_stats_strided_kernel[(n_rows * width // TILE_ELEMENTS, heads, batch)](
            source, partials, tiles, heads, n_rows, *strides, WIDTH=width, **shape
        )
    else:
        smaq_stats_kernel[(tiles,)](source.contiguous(), partials, n, tiles, **shape)
    smaq_combine_kernel[(1,)](
        partials, stats, n, tiles, TILE=TILE_ELEMENTS, CHUNK=COMBINE_CHUNK, **LAUNCH_OPTIONS
    )
    return stats


def _rows_per_tile(block: int) -> int:
    return CODE_TILE_ELEMENTS // block


def strided_tiles(source: torch.Tensor) -> tuple | None:
    """:func:`strided_rows`'s layout of a transposed q, k or v that the strided kernels read
    where it lies: each head's values whole statistics tiles (so every tile is the flat copy's),
    rows no wider than a quantize tile. None for every other tensor (it is copied)."""
    if source.is_contiguous():
        return None
    layout = strided_rows(source, 1, TILE_ELEMENTS)
    return layout if layout is not None and layout[0][3] <= CODE_TILE_ELEMENTS else None


def smaq_quantize_triton(source, block, slots, stochastic, seed=0, device_seed=None):
    """The Triton side of :func:`smaq_quantize_reference`: the statistics (two launches) and the
    codes (one), into one allocation; attention's transposed q, k and v read where they lie."""
    n = source.numel()
    main, extension, stats = one_allocation(smaq_layout(n, block, slots), source.device)
    layout = strided_tiles(source)
    smaq_stats_triton(source, stats, layout)
    if n == 0:
        return main, extension, stats
    rows = _rows_per_tile(block)
    arguments = (
        slots,
        mix_seed(seed) if stochastic and device_seed is None else 0,
        stats if device_seed is None else device_seed,  # an unread pointer without one
    )
    constants = dict(
        STOCHASTIC=bool(stochastic),
        SEED_IN_MEMORY=bool(stochastic) and device_seed is not None,
        BLOCK=block,
        ROWS=rows,
        BYTES_PAD=extension_bytes_pad(slots),
        **LAUNCH_OPTIONS,
    )
    if layout is not None:
        (batch, heads, n_rows, width), strides = layout
        smaq_quantize_strided_kernel[(n_rows * width // (rows * block), heads, batch)](
            source, stats, main, extension, main.numel(), *arguments, heads, n_rows, *strides,
            WIDTH=width, **constants,
        )  # fmt: skip
    else:
        smaq_quantize_kernel[(cdiv(n, rows * block),)](
            source.contiguous(), stats, main, extension, n, main.numel(), *arguments, **constants
        )
    return main, extension, stats


def smaq_dequantize_triton(main, extension, stats, shape, dtype, block, slots):
    """The Triton side of :func:`smaq_dequantize_reference`: one launch."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=stats.device)
    if n:
        rows = _rows_per_tile(block)
        smaq_dequantize_kernel[(cdiv(n, rows * block),)](
            main, extension, stats, out, n, main.numel(), slots, BLOCK=block, ROWS=rows,
            **LAUNCH_OPTIONS,
        )  # fmt: skip
    return out.view(shape)


def _smaq_quantize_fake(source, block, slots, stochastic, seed=0, device_seed=None):
    extension = cdiv(source.numel(), block) * slots // 4
    return (
        source.new_empty(packed_nbytes(source.numel(), 6), dtype=torch.uint8),
        source.new_empty(extension, dtype=torch.uint8),
        source.new_empty(2, dtype=torch.float32),
    )


smaq_quantize = register(
    "smaq_quantize",
    smaq_quantize_reference,
    smaq_quantize_triton,
    fake=_smaq_quantize_fake,
    takes=lambda source, *args: source.dtype in FLOATS and seed_beside(source, *args[4:]),
)
smaq_dequantize = register(
    "smaq_dequantize",
    smaq_dequantize_reference,
    smaq_dequantize_triton,
    fake=lambda main, extension, stats, shape, dtype, *_: main.new_empty(shape, dtype=dtype),
    takes=lambda main, extension, stats, shape, dtype, *_: dtype in FLOATS,
)
