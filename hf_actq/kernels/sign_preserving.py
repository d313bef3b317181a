"""Sign-preserving quantization (``codecs/sign_preserving.py``): ``hf_actq::blpa_quantize`` (block
absmax, step, ceil-based codes, bit packing) and ``hf_actq::blpa_dequantize``, each a PyTorch twin
and a Triton kernel. Deterministic, so the kernels' packed codes equal the twins' bit for bit.
"""

from __future__ import annotations

import math

import torch

from hf_actq.kernels.packing import (
    CODEC_CHUNK,
    pack_chunk_into,
    packed_nbytes,
    pad_to,
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


def blpa_quantize_reference(
    source: torch.Tensor, bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and per-block fp32 steps; ``x > 0`` maps to the upper half of the codes."""
    n = source.numel()
    half = 2 ** (bits - 1)
    blocks = -(-n // block)
    steps = torch.empty(blocks, dtype=torch.float32, device=source.device)
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=source.device)
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


@jit(do_not_specialize=["bits"])
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


@jit(do_not_specialize=["block", "bits"])
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
    """The Triton side of :func:`blpa_quantize_reference`."""
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
    """The Triton side of :func:`blpa_dequantize_reference`."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=steps.device)
    if n:
        grid = (triton.cdiv(n, DEQUANT_BLOCK),)
        blpa_dequantize_kernel[grid](
            data, steps, out, n, data.numel(), block, bits, BLOCK=DEQUANT_BLOCK, **LAUNCH_OPTIONS
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
