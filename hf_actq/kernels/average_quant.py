"""Triton kernels for average quantization (``codecs/average.py``): quantize (group means,
per-block min and scale, stochastic rounding, bit packing in one pass) and dequantize (unpack,
scale, repeat over the group). Twins: ``aq_quantize_reference`` / ``aq_dequantize_reference``.

Stochastic rounding uses Triton's Philox stream keyed by the codec's seed (drawn from torch's
RNG), so ``torch.manual_seed`` and checkpointing's RNG replay reproduce codes; the noise differs
from the twin's counter hash (``kernels/compiled.py:uniform_noise``), so the two agree in
distribution, and bit for bit when deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_actq.kernels.reference import packed_nbytes
from hf_actq.kernels.triton_common import LAUNCH_OPTIONS, load_codes, store_packed, to_dtype

DEQUANT_BLOCK = 1024


@triton.jit(do_not_specialize=["group", "bits", "stochastic", "seed"])
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


@triton.jit(do_not_specialize=["last", "per_row", "group", "block", "bits"])
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
    """Triton twin of :func:`hf_actq.kernels.reference.aq_quantize_reference`."""
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
            seed if seed is not None else 0,  # deterministic rounding: unused
            BLOCK=block,
            **LAUNCH_OPTIONS,
        )
    return packed, mins, scales


def aq_dequantize_triton(data, mins, scales, shape, dtype, bits, group, block):
    """Triton twin of :func:`hf_actq.kernels.reference.aq_dequantize_reference`."""
    n = shape.numel()
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
