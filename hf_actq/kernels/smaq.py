"""Triton kernels for SmaQ (``codecs/smaq.py``): quantize (z-score, stochastic rounding, 6-bit
main codes, per-block 2-bit extension slots filled in element order by a block-local cumsum)
and dequantize. Twins: ``smaq_quantize_reference`` / ``smaq_dequantize_reference``; bit-exact
with deterministic rounding, equal in distribution with stochastic rounding (Philox noise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_actq.kernels.reference import packed_nbytes
from hf_actq.kernels.triton_common import LAUNCH_OPTIONS, load_codes, store_packed, to_dtype


@triton.jit(do_not_specialize=["slots", "stochastic", "seed"])
def smaq_quantize_kernel(
    src_ptr,
    stats_ptr,
    main_ptr,
    ext_ptr,
    n_elements,
    n_main_bytes,
    slots,
    stochastic,
    seed,
    BLOCK: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n_elements
    x = tl.load(src_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    mean = tl.load(stats_ptr)
    std = tl.load(stats_ptr + 1)
    inv_std = tl.where(std > 0, tl.math.div_rn(1.0, std), 0.0)
    z = tl.minimum(tl.maximum((x - mean) * inv_std, -2.0), 2.0)
    if stochastic != 0:  # noqa: SIM108 (a runtime branch inside a Triton kernel)
        u = tl.rand(seed, offsets)
    else:
        u = tl.full([BLOCK], 0.5, tl.float32)
    outlier = (tl.abs(z) > 1.0) & valid
    inlier_code = tl.minimum(tl.maximum(tl.floor((z + 1.0) * 15.5 + u), 0.0), 31.0)
    magnitude = tl.abs(z) - 1.0
    fine = tl.minimum(tl.maximum(tl.floor(magnitude * 63.0 + u), 0.0), 63.0)
    coarse = tl.minimum(tl.maximum(tl.floor(magnitude * 15.0 + u), 0.0), 15.0)
    rank = tl.cumsum(outlier.to(tl.int32), axis=0) - 1
    extended = outlier & (rank < slots)
    top = tl.where(extended, tl.floor(tl.math.div_rn(fine, 4.0)), coarse)
    sign = tl.where(z < 0, 16.0, 0.0)
    code = tl.where(outlier, 32.0 + sign + top, inlier_code)
    code = tl.where(valid, code, 0.0).to(tl.uint32)
    groups8 = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    store_packed(main_ptr, groups8, tl.reshape(code, (BLOCK // 8, 8)), 6, n_main_bytes)

    # Slot j of this block holds the low 2 magnitude bits of its outlier of rank j.
    low = fine - 4.0 * tl.floor(tl.math.div_rn(fine, 4.0))
    slot = tl.arange(0, SLOTS_PAD)
    match = (rank[:, None] == slot[None, :]) & extended[:, None]
    values = tl.sum(tl.where(match, low[:, None], 0.0), axis=0).to(tl.uint32)
    quads = tl.reshape(values, (SLOTS_PAD // 4, 4))
    byte = tl.sum(quads << (tl.arange(0, 4)[None, :] * 2).to(tl.uint32), axis=1)
    byte_index = tl.arange(0, SLOTS_PAD // 4)
    tl.store(
        ext_ptr + pid * (slots // 4) + byte_index, byte.to(tl.uint8), mask=byte_index < slots // 4
    )


@triton.jit(do_not_specialize=["slots"])
def smaq_dequantize_kernel(
    main_ptr,
    ext_ptr,
    stats_ptr,
    out_ptr,
    n_elements,
    n_main_bytes,
    n_ext_bytes,
    slots,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < n_elements
    code = load_codes(main_ptr, offsets, valid, 6, n_main_bytes)
    outlier = (code >= 32) & valid
    top = (code & 15).to(tl.float32)
    rank = tl.cumsum(outlier.to(tl.int32), axis=0) - 1
    extended = outlier & (rank < slots)
    slot_index = pid * slots + tl.maximum(rank, 0).to(tl.int64)
    low = load_codes(ext_ptr, slot_index, extended, 2, n_ext_bytes).to(tl.float32)
    magnitude = tl.where(extended, tl.math.div_rn(4.0 * top + low, 63.0), tl.math.div_rn(top, 15.0))
    sign = tl.where((code & 16) > 0, -1.0, 1.0)
    z = tl.where(outlier, sign * (1.0 + magnitude), tl.math.div_rn(code.to(tl.float32), 15.5) - 1.0)
    value = z * tl.load(stats_ptr + 1) + tl.load(stats_ptr)
    tl.store(out_ptr + offsets, to_dtype(value, out_ptr.dtype.element_ty), mask=valid)


def smaq_quantize_triton(source, stats, block, slots, stochastic, seed=0):
    """Triton twin of :func:`hf_actq.kernels.reference.smaq_quantize_reference`."""
    source = source.contiguous()
    n = source.numel()
    blocks = triton.cdiv(n, block)
    main = torch.empty(packed_nbytes(n, 6), dtype=torch.uint8, device=source.device)
    extension = torch.empty(blocks * slots // 4, dtype=torch.uint8, device=source.device)
    if n:
        smaq_quantize_kernel[(blocks,)](
            source,
            stats,
            main,
            extension,
            n,
            main.numel(),
            slots,
            int(stochastic),
            seed if seed is not None else 0,  # deterministic rounding: unused
            BLOCK=block,
            SLOTS_PAD=block,
            **LAUNCH_OPTIONS,
        )
    return main, extension


def smaq_dequantize_triton(main, extension, stats, shape, dtype, block, slots):
    """Triton twin of :func:`hf_actq.kernels.reference.smaq_dequantize_reference`."""
    n = shape.numel()
    out = torch.empty(n, dtype=dtype, device=stats.device)
    if n:
        smaq_dequantize_kernel[(triton.cdiv(n, block),)](
            main,
            extension,
            stats,
            out,
            n,
            main.numel(),
            extension.numel(),
            slots,
            BLOCK=block,
            **LAUNCH_OPTIONS,
        )
    return out.view(shape)
