"""PyTorch twins of the Triton kernels: the CPU path and the test oracle.

Every function here has the signature and the output (bit for bit, packed codes included) of its
Triton launcher in the sibling module of the same op.

Bit layout shared by every kernel: code ``i`` of width ``b`` occupies bits ``[i*b, (i+1)*b)`` of a
little-endian bit stream, so ``n`` codes take exactly ``ceil(n*b/8)`` bytes. Eight codes always
fill exactly ``b`` whole bytes, which lets kernels pack and unpack groups of eight independently.

Work proceeds in chunks of ``CHUNK`` elements so that temporaries stay in cache and their size is
bounded no matter how large the tensor is (no int64 index tensor the size of the input).
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
import torch

from hf_actq.fewbit.activations import get_activation
from hf_actq.kernels.compiled import mix_seed, run, uniform_noise, use_compiled

if sys.byteorder != "little":
    raise ImportError(
        "hf_actq's bit packing views words as bytes and needs a little-endian machine"
    )

# 256 Ki elements: 1 MiB of fp32, small enough for L2, large enough to amortise op dispatch.
CHUNK = 1 << 18


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits: ``ceil(numel * bits / 8)``."""
    return (numel * bits + 7) // 8


def fewbit_forward_reference(
    x: torch.Tensor,
    activation: str,
    borders: torch.Tensor,
    bits: int,
    params: tuple[float, ...] = (),
    output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Activation output (None with ``output=False``), packed ``bits``-bit codes and a NaN flag,
    in one call.

    ``borders`` (fp32) are the table's interior cut points, or ``(lo, hi)`` for activations whose
    derivative takes two values. Returns ``y`` (exactly ``activation``'s PyTorch output),
    ``packed`` (uint8, ``ceil(n*bits/8)`` bytes) and ``nan_flag`` (int32 of shape (1,), non-zero
    when ``x`` holds a NaN: codes cannot say where, so backward then yields NaN gradients rather
    than silently finite ones).
    """
    spec = get_activation(activation)
    y = spec.forward(x, **dict(zip(spec.params, params))) if output else None
    n = x.numel()
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    flat = x.reshape(-1)
    cuts = tuple(borders.tolist())
    if use_compiled(flat):
        # Comparisons and packing fused by the compiler: a few passes instead of a dozen.
        nan_seen = torch.zeros(1, dtype=torch.bool, device=x.device)
        key = (x.dtype, cuts, spec.code_mode, bits)
        for start in range(0, n, _COMPILED_CHUNK):
            part = flat[start : start + _COMPILED_CHUNK]
            m = part.numel()
            if m % 8:
                part = torch.cat([part, part.new_zeros(8 - m % 8)])
            nan_seen |= torch.isnan(part.max())
            codes = run(True, _fewbit_codes, key, part, cuts, spec.code_mode)
            codes[m:] = 0  # as the eager path packs the tail
            _pack_uint8_codes_into(codes, bits, packed, start, True)
        return y, packed, nan_seen.to(torch.int32)
    lut = None
    if spec.code_mode in ("table", "symmetric"):
        lut = code_lookup_table(cuts, spec.code_mode == "symmetric", x.dtype, x.device)
    nan_seen = torch.zeros(1, dtype=torch.bool, device=x.device)
    codes = torch.zeros(min(n, CHUNK) + 8, dtype=torch.float32, device=x.device)
    hits = torch.empty(min(n, CHUNK), dtype=torch.float32, device=x.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        part = flat[start:stop]
        # max() propagates NaN, so one cheap reduction over cached data finds any NaN.
        nan_seen |= torch.isnan(part.max())
        c = codes[:m]
        if lut is not None:
            torch.index_select(lut, 0, _top16_bits(part), out=c)
        else:
            # Compare in fp32 as the Triton kernel does: a Python scalar against a bf16 tensor
            # would be rounded to bf16 first and move the border.
            v = part.float()
            torch.gt(v, cuts[0], out=c)
            if spec.code_mode == "interval":
                torch.lt(v, cuts[1], out=hits[:m])
                c.mul_(hits[:m])
        padded = (m + 7) // 8 * 8
        codes[m:padded] = 0
        byte_start, nbytes = start * bits // 8, packed_nbytes(m, bits)
        if padded == m:
            _pack_into(codes[:padded], bits, packed[byte_start : byte_start + nbytes])
        else:
            tail = torch.empty(padded * bits // 8, dtype=torch.uint8, device=x.device)
            _pack_into(codes[:padded], bits, tail)
            packed[byte_start : byte_start + nbytes] = tail[:nbytes]
    return y, packed, nan_seen.to(torch.int32)


def _fewbit_codes(part, cuts: tuple, code_mode: str):
    """uint8 codes of ``part``: the comparisons that :func:`code_lookup_table` tabulates (on the
    top 16 bits of the fp32 value for "table" and "symmetric", on the fp32 value otherwise),
    written out for the compiler. Counted in fp32: inductor's uint8 additions do not vectorize.
    """
    v = part.float()
    if code_mode in ("table", "symmetric"):
        v = (v.view(torch.int32) & -65536).view(torch.float32)
        if code_mode == "symmetric":
            v = v.abs()
    codes = torch.where(v > cuts[0], 1.0, 0.0)
    if code_mode == "interval":
        codes = torch.where(v < cuts[1], codes, 0.0)
    elif code_mode in ("table", "symmetric"):
        for cut in cuts[1:]:
            codes = codes + torch.where(v > cut, 1.0, 0.0)
    return codes.to(torch.uint8)


@functools.lru_cache(maxsize=64)
def code_lookup_table(
    cuts: tuple[float, ...], symmetric: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The code of every 16-bit pattern: ``x``'s top 16 bits for fp32 (bf16 truncation), the
    whole value for bf16 and fp16. Exactly the Triton kernel's comparisons, one lookup each."""
    patterns = np.arange(65536, dtype=np.uint32)
    if dtype == torch.float16:
        values = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
        values = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    else:
        values = (patterns << np.uint32(16)).view(np.float32)
    if symmetric:
        values = np.abs(values)
    with np.errstate(invalid="ignore"):
        codes = (values[:, None] > np.asarray(cuts, dtype=np.float32)[None, :]).sum(axis=1)
    return torch.from_numpy(codes.astype(np.float32)).to(device)


def _top16_bits(part: torch.Tensor) -> torch.Tensor:
    """int32 index of each element's 16-bit pattern (see :func:`code_lookup_table`)."""
    if part.dtype in (torch.bfloat16, torch.float16):
        return part.view(torch.uint16).to(torch.int32)
    if part.dtype != torch.float32:
        part = part.float()
    return part.view(torch.uint16)[1::2].to(torch.int32)  # the high half, little-endian


def fewbit_backward_reference(
    grad_y: torch.Tensor,
    packed: torch.Tensor,
    levels: torch.Tensor,
    nan_flag: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    """``grad_y * levels[code]``, the product taken in fp32 and rounded once to grad_y's dtype."""
    n = grad_y.numel()
    flat = grad_y.reshape(-1)
    lut = levels.float() * torch.where(nan_flag.bool(), math.nan, 1.0)
    expanded, index_of = _expanded_lookup(lut, bits)
    out = torch.empty(n, dtype=grad_y.dtype, device=grad_y.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        byte_start = start * bits // 8
        chunk = packed[byte_start : byte_start + packed_nbytes(m, bits)]
        group_bytes = (m + 7) // 8 * bits
        if chunk.numel() < group_bytes:
            chunk = torch.cat([chunk, chunk.new_zeros(group_bytes - chunk.numel())])
        level = expanded.index_select(0, index_of(chunk)).view(-1)[:m]
        torch.mul(flat[start:stop], level, out=out[start:stop])
    return out.view(grad_y.shape)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (each < 2**bits, bits in 1..8) into ``ceil(n*bits/8)`` bytes."""
    n = codes.numel()
    codes = codes.reshape(-1)
    out = torch.empty((n + 7) // 8 * bits, dtype=torch.uint8, device=codes.device)
    flat = torch.zeros(min(n, CHUNK) + 8, dtype=torch.float32, device=codes.device)
    for start in range(0, n, CHUNK):  # CHUNK is a multiple of 8: chunks start on whole bytes
        stop = min(n, start + CHUNK)
        padded = (stop - start + 7) // 8 * 8
        flat[padded - 8 : padded] = 0  # a short last chunk packs zeros after its codes
        flat[: stop - start] = codes[start:stop]
        _pack_into(
            flat[:padded], bits, out[start // 8 * bits : start // 8 * bits + padded // 8 * bits]
        )
    return out[: packed_nbytes(n, bits)]


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``numel`` uint8 codes."""
    groups = (numel + 7) // 8
    data = torch.zeros(groups * bits, dtype=torch.uint8, device=packed.device)
    data[: packed.numel()] = packed
    if bits in (1, 2, 3, 4, 8):
        table, index_of = _code_table(bits, packed.device)
        return table.index_select(0, index_of(data)).view(-1)[:numel]
    words = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    words[:, :bits] = data.view(groups, bits)
    words = words.view(torch.int64).view(-1, 1)
    shifts = torch.arange(8, device=packed.device) * bits
    return ((words >> shifts) & (2**bits - 1)).to(torch.uint8).view(-1)[:numel]


def _pack_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack a multiple-of-8 run of fp32 codes into ``out``. Integer shifts, not a float
    product: autocast would run a product in bf16, whose 8-bit mantissa cannot hold a 3-bit
    word's 24 bits."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8 for packing, got {bits}")
    words = _packed_words(codes, bits)
    out.view(-1, bits).copy_(words.view(torch.uint8).view(words.numel(), -1)[:, :bits])


def _expanded_lookup(lut: torch.Tensor, bits: int):
    """A table of levels per packed index, and how to index it from packed bytes.

    Decoding byte by byte (or 12 bits at a time for 3-bit codes, which straddle bytes) turns
    unpacking and the level lookup into one row gather.
    """
    codes, index_of = _code_table(bits, lut.device)
    return lut[codes.long()], index_of


@functools.lru_cache(maxsize=32)
def _code_table(bits: int, device: torch.device):
    """The uint8 codes each packed index holds (one byte, or 12 bits for 3-bit codes), cached:
    this runs on every unpack (uint8 so that the cache stays at 16 KiB)."""
    if bits in (1, 2, 4, 8):
        per_byte = 8 // bits
        index = torch.arange(256, device=device)
        shifts = torch.arange(per_byte, device=device) * bits
        return ((index[:, None] >> shifts) & (2**bits - 1)).to(torch.uint8), _byte_index
    if bits == 3:
        index = torch.arange(4096, device=device)
        shifts = torch.arange(4, device=device) * 3
        return ((index[:, None] >> shifts) & 7).to(torch.uint8), _twelve_bit_index
    raise ValueError(f"bits must be one of 1, 2, 3, 4, 8 for unpacking, got {bits}")


def _byte_index(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.to(torch.int32)


def _twelve_bit_index(chunk: torch.Tensor) -> torch.Tensor:
    b = chunk.view(-1, 3).to(torch.int32)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return torch.stack([word & 0xFFF, word >> 12], dim=1).view(-1)


# Average quantization (codecs/average.py) --------------------------------------------------------
_CODEC_CHUNK = 1 << 16  # means per eager chunk; a multiple of every allowed block size
_COMPILED_CHUNK = 1 << 22  # means per compiled chunk: bounds the uint8 codes between the passes


def aq_quantize_reference(
    source: torch.Tensor, group: int, bits: int, block: int, stochastic: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the means of consecutive ``group``-element runs of flat ``source``.

    Returns packed ``bits``-bit codes and per-block fp32 minimums and scales. Means are fp32 sums
    in order, divided by ``group`` and rounded to ``source``'s dtype (as the Triton kernel does)
    before quantization; stochastic rounding adds :func:`uniform_noise` of each mean's index keyed
    by ``seed``, deterministic rounding is ``floor(q + 0.5)``. Codes past the last mean are zero.
    """
    m = source.numel() // group
    blocks = -(-m // block)
    device = source.device
    mins = torch.empty(blocks, dtype=torch.float32, device=device)
    scales = torch.empty(blocks, dtype=torch.float32, device=device)
    packed = torch.empty(packed_nbytes(m, bits), dtype=torch.uint8, device=device)
    compiled = use_compiled(source)
    noise_key = torch.tensor(mix_seed(seed if stochastic else 0), dtype=torch.int32)
    key = (source.dtype, group, bits, stochastic)
    step = _COMPILED_CHUNK if compiled else _CODEC_CHUNK
    for start in range(0, m, step):
        count = min(step, m - start)
        rows = -(-count // block)
        chunk = source[start * group : (start + count) * group]
        if count < rows * block:  # the last block is partial: repeat the last mean's run
            repeat = chunk[-group:].repeat(rows * block - count)
            chunk = torch.cat([chunk, repeat])
        offset = torch.tensor(_as_int32(start), dtype=torch.int32)
        rows_view = chunk.view(rows, block, group)
        codes, lo, scale = run(
            compiled, _aq_codes, key, rows_view, bits, noise_key, offset, group, stochastic
        )
        codes = codes.view(-1)
        codes[count:] = 0
        mins[start // block : start // block + rows] = lo
        scales[start // block : start // block + rows] = scale
        _pack_uint8_codes_into(codes, bits, packed, start, compiled)
    return packed, mins, scales


def _aq_codes(rows, bits: int, noise_key, offset, group: int, stochastic: bool):
    """Codes (uint8 [R, block]) and fp32 minimum and scale per row of ``rows`` [R, block, group].
    One pass when compiled; the Triton kernel's arithmetic, step for step."""
    total = rows[..., 0].float()
    for k in range(1, group):  # in order, as the Triton kernel sums
        total = total + rows[..., k].float()
    means = (total / group).to(rows.dtype).float()
    top = float(2**bits - 1)
    lo, hi = means.amin(dim=1), means.amax(dim=1)
    # hi / top - lo / top rather than (hi - lo) / top, which overflows for huge ranges.
    scale = hi / top - lo / top
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
    shape: torch.Size,
    dtype: torch.dtype,
    bits: int,
    group: int,
    block: int,
) -> torch.Tensor:
    """The tensor of ``shape``: each dequantized mean repeated over its group along the last dim
    (the last group of a row may be partial)."""
    n = shape.numel()
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    last = shape[-1] if len(shape) else 1
    per_row = -(-last // group)
    m = (n // last) * per_row
    means = torch.empty(m, dtype=dtype, device=data.device)
    compiled = use_compiled(means)
    step = _COMPILED_CHUNK if compiled else _CODEC_CHUNK
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


def _packed_words(codes, bits: int):
    """Words of ``codes`` (integers in uint8 or fp32, a multiple of 8) holding code ``j`` of each 8 at bit ``j*bits``:
    int32 up to 3 bits, int64 above (sign bits wrap, the bytes are what count)."""
    c = codes.view(-1, 8).to(torch.int32 if bits <= 3 else torch.int64)
    word = c[:, 0]
    for j in range(1, 8):
        word = word | (c[:, j] << (bits * j))
    return word


def _pack_uint8_codes_into(codes, bits, packed, start, compiled) -> None:
    """Pack uint8 ``codes`` (a multiple of 8) of elements ``start...`` (a multiple of 8) into
    ``packed``, which ends at the last real code's byte."""
    words = run(compiled, _packed_words, (bits,), codes, bits)
    low_bytes = words.view(torch.uint8).view(words.numel(), -1)[:, :bits]
    byte_start = start * bits // 8
    whole_groups = min(words.numel(), (packed.numel() - byte_start) // bits)
    # Straight into place (no full-size copy in between); a partial last group byte by byte.
    end = byte_start + whole_groups * bits
    packed[byte_start:end].view(whole_groups, bits).copy_(low_bytes[:whole_groups])
    if whole_groups < words.numel():
        packed[end:] = low_bytes[whole_groups].reshape(-1)[: packed.numel() - end]


def _as_int32(value: int) -> int:
    """``value`` modulo 2**32 as a signed int32 (noise counters wrap)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _pack_chunk_into(codes: torch.Tensor, bits: int, packed: torch.Tensor, start: int) -> None:
    """Pack fp32 ``codes`` of elements ``start...`` (start a multiple of 8) into ``packed``."""
    m = codes.numel()
    byte_start, nbytes = start * bits // 8, packed_nbytes(m, bits)
    if m % 8 == 0:
        _pack_into(codes, bits, packed[byte_start : byte_start + nbytes])
        return
    padded = _padded(codes, (m + 7) // 8 * 8, 0.0)
    tail = torch.empty(padded.numel() * bits // 8, dtype=torch.uint8, device=codes.device)
    _pack_into(padded, bits, tail)
    packed[byte_start : byte_start + nbytes] = tail[:nbytes]


def _padded(chunk: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    if chunk.numel() == size:
        return chunk
    out = torch.full((size,), fill, dtype=chunk.dtype, device=chunk.device)
    out[: chunk.numel()] = chunk
    return out


# Sign-preserving quantization (codecs/sign_preserving.py) ----------------------------------------
def blpa_quantize_reference(
    source: torch.Tensor, bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and per-block fp32 steps; ``x > 0`` maps to the upper half of the codes."""
    n = source.numel()
    half = 2 ** (bits - 1)
    blocks = -(-n // block)
    steps = torch.empty(blocks, dtype=torch.float32, device=source.device)
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=source.device)
    for start in range(0, n, _CODEC_CHUNK):
        stop = min(n, start + _CODEC_CHUNK)
        chunk = source[start:stop].float()
        rows = -(-chunk.numel() // block)
        step = _padded(chunk.abs(), rows * block, 0.0).view(rows, block).amax(dim=1) / half
        steps[start // block : start // block + rows] = step
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
        # ceil(x / step) - 1: x in (0, step] -> 0 (upper half); x = 0 -> -1 (lower half).
        rows_view = _padded(chunk, rows * block, 0.0).view(rows, block)
        q = torch.ceil(rows_view * inv[:, None]).view(-1)[: stop - start]
        _pack_chunk_into(q.sub_(1.0).clamp_(-half, half - 1).add_(half), bits, packed, start)
    return packed, steps


def blpa_dequantize_reference(
    data: torch.Tensor,
    steps: torch.Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
    bits: int,
    block: int,
) -> torch.Tensor:
    n = shape.numel()
    middle = 2 ** (bits - 1) - 0.5
    codes = unpack_codes(data, n, bits)
    out = torch.empty(n, dtype=dtype, device=data.device)
    for start in range(0, n, _CODEC_CHUNK):
        stop = min(n, start + _CODEC_CHUNK)
        rows = -(-(stop - start) // block)
        b0 = start // block
        c = _padded(codes[start:stop].float() - middle, rows * block, 0.0).view(rows, block)
        values = c * steps[b0 : b0 + rows, None]
        out[start:stop] = values.view(-1)[: stop - start].to(dtype)
    return out.view(shape)


# Masks (codecs/mask.py) ----------------------------------------------------------------------------
def mask_pack_reference(source: torch.Tensor) -> torch.Tensor:
    """``source != 0`` packed to 1 bit per element."""
    # `!= 0` on a bool tensor would first promote it to int64.
    return pack_codes(source if source.dtype == torch.bool else source != 0, 1)


def mask_unpack_reference(
    data: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    return unpack_codes(data, shape.numel(), 1).to(dtype).view(shape)


# SmaQ (codecs/smaq.py) ---------------------------------------------------------------------------
_SMAQ_CHUNK_BLOCKS = 256


def smaq_quantize_reference(
    source: torch.Tensor,
    stats: torch.Tensor,
    block: int,
    slots: int,
    stochastic: bool,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed 6-bit main codes and packed 2-bit extension slots (``slots`` per block) of flat
    ``source`` given its fp32 ``[mean, std]``; see ``codecs/smaq.py`` for the layout."""
    n = source.numel()
    device = source.device
    mean, std = stats[0], stats[1]
    inv_std = torch.where(std > 0, 1.0 / std, torch.zeros_like(std))
    generator = None
    if stochastic:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    blocks = -(-n // block)
    main = torch.empty(packed_nbytes(n, 6), dtype=torch.uint8, device=device)
    extension = torch.zeros(blocks, max(slots, 1), dtype=torch.float32, device=device)
    step = _SMAQ_CHUNK_BLOCKS * block
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = -(-(stop - start) // block)
        chunk = _padded(source[start:stop].float(), rows * block, 0.0)
        z = ((chunk - mean) * inv_std).clamp_(-2.0, 2.0).view(rows, block)
        if stochastic:
            u = torch.rand(z.shape, device=device, generator=generator)
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
        _pack_chunk_into(code.view(-1)[: stop - start], 6, main, start)
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
    shape: torch.Size,
    dtype: torch.dtype,
    block: int,
    slots: int,
) -> torch.Tensor:
    n = shape.numel()
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
    magnitude = top / 15.0
    if slots:
        ext = unpack_codes(extension, blocks * slots, 2).view(blocks, slots).float()
        low = ext.gather(1, rank.clamp(0, slots - 1).to(torch.int64))
        magnitude = torch.where(extended, (4 * top + low) / 63.0, magnitude)
    sign = torch.where((codes & 16) > 0, -1.0, 1.0)
    z = torch.where(outlier, sign * (1.0 + magnitude), codes.float() / 15.5 - 1.0)
    values = z.view(-1)[:n] * stats[1] + stats[0]
    return values.to(dtype).view(shape)


# fp32 elements a chunked twin materialises at a time (16 MiB): bounds the transients of the
# norms' forward and backward and the dropout twin's random draws on any input, where one
# full-size fp32 copy of a bf16 activation would be twice its size.
CHUNK_ELEMENTS = 1 << 22


def row_chunks(n_rows: int, width: int, budget: int = CHUNK_ELEMENTS):
    """Slices of consecutive rows holding at most ``budget`` elements (at least one row)."""
    step = max(1, budget // max(width, 1))
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


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


def norm_backward_reference(grad_y, x_hat, rstd, weight, centered: bool):
    """Backward of LayerNorm (``centered``) or RMSNorm from the normalized input ``x_hat`` and the
    per-row ``rstd``: ``grad_x`` in ``grad_y``'s dtype, and the fp32 weight and bias gradients
    (``sum g * x_hat`` and ``sum g`` over rows). fp32 arithmetic, chunked over rows."""
    width = grad_y.shape[-1]
    grad = grad_y.reshape(-1, width)
    x_hat = x_hat.reshape(-1, width)
    rstd = rstd.reshape(-1, 1)
    w = None if weight is None else weight.float()
    grad_x = torch.empty_like(grad)
    grad_w = torch.zeros(width, dtype=torch.float32, device=grad.device)
    grad_b = torch.zeros_like(grad_w)
    for rows in row_chunks(grad.shape[0], width):
        g, xh = grad[rows].float(), x_hat[rows].float()
        gw = g if w is None else g * w
        mean_gwx = (gw * xh).mean(-1, keepdim=True)
        if centered:
            gw = gw - gw.mean(-1, keepdim=True)
        grad_x[rows] = rstd[rows] * (gw - xh * mean_gwx)
        grad_w += (g * xh).sum(0)
        grad_b += g.sum(0)
    return grad_x.view(grad_y.shape), grad_w, grad_b
