"""Average quantization (``codecs/average.py``): ``hf_actq::aq_quantize`` (group means, per-block
min and scale, stochastic rounding, bit packing) and ``hf_actq::aq_dequantize`` (unpack, scale,
repeat over the group), each a PyTorch twin and a Triton kernel that does it in one pass.

Stochastic rounding uses Triton's Philox stream keyed by the codec's seed (drawn from torch's
RNG), so ``torch.manual_seed`` and checkpointing's RNG replay reproduce codes; the noise differs
from the twin's counter hash (``kernels/compiled.py:uniform_noise``), so the two agree in
distribution, and bit for bit when deterministic.
"""

from __future__ import annotations

import math

import torch

from hf_actq.kernels.compiled import mix_seed, run, uniform_noise, use_compiled
from hf_actq.kernels.packing import (
    CODEC_CHUNK,
    COMPILED_CHUNK,
    divided,
    pack_uint8_codes_into,
    packed_nbytes,
    unpack_codes,
)
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    jit,
    load_codes,
    store_packed,
    tl,
    to_dtype,
    triton,
)

DEQUANT_BLOCK = 1024


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
    step = COMPILED_CHUNK if compiled else CODEC_CHUNK
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


def _as_int32(value: int) -> int:
    """``value`` modulo 2**32 as a signed int32 (noise counters wrap)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


@jit(do_not_specialize=["group", "bits", "stochastic", "seed"])
def aq_quantize_kernel(
    src_ptr,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    n_means,
    n_bytes,
    group,
    bits,
    stochastic,
    seed,
    BLOCK: tl.constexpr,
):
    # One program per block of BLOCK means, laid out as [BLOCK // 8, 8] for packing.
    pid = tl.program_id(0).to(tl.int64)
    groups8 = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    mean_idx = groups8[:, None] * 8 + tl.arange(0, 8)[None, :]
    valid = mean_idx < n_means
    acc = tl.zeros([BLOCK // 8, 8], dtype=tl.float32)
    for k in range(group):
        acc += tl.load(src_ptr + mean_idx * group + k, mask=valid, other=0.0).to(tl.float32)
    # Means are rounded to the source dtype, as the twin does.
    mean = to_dtype(tl.math.div_rn(acc, group.to(tl.float32)), src_ptr.dtype.element_ty)
    mean = mean.to(tl.float32)

    lo = tl.min(tl.where(valid, mean, float("inf")))
    hi = tl.max(tl.where(valid, mean, float("-inf")))
    top = ((1 << bits) - 1).to(tl.float32)
    scale = tl.math.div_rn(hi, top) - tl.math.div_rn(lo, top)
    inv = tl.where(scale > 0, tl.math.div_rn(1.0, scale), 0.0)
    q = mean * inv - lo * inv
    if stochastic != 0:  # noqa: SIM108 (a runtime branch inside a Triton kernel)
        q = q + tl.rand(seed, mean_idx)
    else:
        q = q + 0.5
    q = tl.minimum(tl.maximum(tl.floor(q), 0.0), top)
    code = tl.where(valid, q, 0.0).to(tl.uint32)
    store_packed(packed_ptr, groups8, code, bits, n_bytes)
    tl.store(mins_ptr + pid, lo)
    tl.store(scales_ptr + pid, scale)


@jit(do_not_specialize=["last", "per_row", "group", "block", "bits"])
def aq_dequantize_kernel(
    packed_ptr,
    mins_ptr,
    scales_ptr,
    out_ptr,
    n_elements,
    n_bytes,
    last,
    per_row,
    group,
    block,
    bits,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    mean = (offsets // last) * per_row + (offsets % last) // group
    code = load_codes(packed_ptr, mean, mask, bits, n_bytes)
    blk = mean // block
    lo = tl.load(mins_ptr + blk, mask=mask, other=0.0)
    scale = tl.load(scales_ptr + blk, mask=mask, other=0.0)
    value = lo + code.to(tl.float32) * scale
    tl.store(out_ptr + offsets, to_dtype(value, out_ptr.dtype.element_ty), mask=mask)


def aq_quantize_triton(source, group, bits, block, stochastic, seed=0):
    """The Triton side of :func:`aq_quantize_reference`."""
    source = source.contiguous()
    m = source.numel() // group
    blocks = triton.cdiv(m, block)
    packed = torch.empty(packed_nbytes(m, bits), dtype=torch.uint8, device=source.device)
    mins = torch.empty(blocks, dtype=torch.float32, device=source.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=source.device)
    if m:
        aq_quantize_kernel[(blocks,)](
            source,
            packed,
            mins,
            scales,
            m,
            packed.numel(),
            group,
            bits,
            int(stochastic),
            seed,  # deterministic rounding: unused
            BLOCK=block,
            **LAUNCH_OPTIONS,
        )
    return packed, mins, scales


def aq_dequantize_triton(data, mins, scales, shape, dtype, bits, group, block):
    """The Triton side of :func:`aq_dequantize_reference`."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=mins.device)
    if n:
        last = shape[-1] if len(shape) else 1
        grid = (triton.cdiv(n, DEQUANT_BLOCK),)
        aq_dequantize_kernel[grid](
            data,
            mins,
            scales,
            out,
            n,
            data.numel(),
            last,
            -(-last // group),
            group,
            block,
            bits,
            BLOCK=DEQUANT_BLOCK,
            **LAUNCH_OPTIONS,
        )
    return out.view(shape)


def _aq_quantize_fake(source, group, bits, block, stochastic, seed=0):
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
    takes=lambda source, *_: source.dtype in FLOATS,
)
aq_dequantize = register(
    "aq_dequantize",
    aq_dequantize_reference,
    aq_dequantize_triton,
    fake=lambda data, mins, scales, shape, dtype, *_: data.new_empty(shape, dtype=dtype),
    takes=lambda data, mins, scales, shape, dtype, *_: dtype in FLOATS,
)
