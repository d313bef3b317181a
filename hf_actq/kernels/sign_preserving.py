"""Triton kernels for sign-preserving quantization (``codecs/sign_preserving.py``): quantize
(block absmax, step, ceil-based codes, bit packing) and dequantize. Deterministic, so packed
codes equal the twins' (``blpa_quantize_reference`` / ``blpa_dequantize_reference``) bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_actq.kernels.reference import packed_nbytes
from hf_actq.kernels.triton_common import LAUNCH_OPTIONS, load_codes, store_packed, to_dtype

DEQUANT_BLOCK = 1024


@triton.jit(do_not_specialize=["bits"])
def blpa_quantize_kernel(
    src_ptr, packed_ptr, steps_ptr, n_elements, n_bytes, bits, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    groups8 = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = groups8[:, None] * 8 + tl.arange(0, 8)[None, :]
    valid = offsets < n_elements
    x = tl.load(src_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    half = (1 << (bits - 1)).to(tl.float32)
    step = tl.math.div_rn(tl.max(tl.abs(x)), half)
    inv = tl.where(step > 0, tl.math.div_rn(1.0, step), 0.0)
    # ceil(x / step) - 1: x in (0, step] -> 0 (upper half); x = 0 -> -1 (lower half).
    q = tl.minimum(tl.maximum(tl.ceil(x * inv) - 1.0, -half), half - 1.0) + half
    store_packed(packed_ptr, groups8, tl.where(valid, q, 0.0).to(tl.uint32), bits, n_bytes)
    tl.store(steps_ptr + pid, step)


@triton.jit(do_not_specialize=["block", "bits"])
def blpa_dequantize_kernel(
    packed_ptr, steps_ptr, out_ptr, n_elements, n_bytes, block, bits, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    code = load_codes(packed_ptr, offsets, mask, bits, n_bytes).to(tl.float32)
    step = tl.load(steps_ptr + offsets // block, mask=mask, other=0.0)
    middle = (1 << (bits - 1)).to(tl.float32) - 0.5
    tl.store(
        out_ptr + offsets, to_dtype((code - middle) * step, out_ptr.dtype.element_ty), mask=mask
    )


def blpa_quantize_triton(source, bits, block):
    """Triton twin of :func:`hf_actq.kernels.reference.blpa_quantize_reference`."""
    source = source.contiguous()
    n = source.numel()
    blocks = triton.cdiv(n, block)
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=source.device)
    steps = torch.empty(blocks, dtype=torch.float32, device=source.device)
    if n:
        blpa_quantize_kernel[(blocks,)](
            source, packed, steps, n, packed.numel(), bits, BLOCK=block, **LAUNCH_OPTIONS
        )
    return packed, steps


def blpa_dequantize_triton(data, steps, shape, dtype, bits, block):
    """Triton twin of :func:`hf_actq.kernels.reference.blpa_dequantize_reference`."""
    n = shape.numel()
    out = torch.empty(n, dtype=dtype, device=steps.device)
    if n:
        grid = (triton.cdiv(n, DEQUANT_BLOCK),)
        blpa_dequantize_kernel[grid](
            data, steps, out, n, data.numel(), block, bits, BLOCK=DEQUANT_BLOCK, **LAUNCH_OPTIONS
        )
    return out.view(shape)
