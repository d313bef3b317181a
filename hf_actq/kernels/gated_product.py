"""The gated MLP's product ``act(gate) * up`` backward in one pass: ``hf_actq::gated_backward``,
a PyTorch twin and a Triton kernel.

From ``grad_h`` (the product's gradient), act(gate) and up packed by the uniform/AQ codec and
act's few-bit codes, it returns ``grad_gate = act'(gate) * (grad_h * up)``, ``grad_up = grad_h *
act(gate)`` and, where the down projection's weight gradient needs it, the product ``act(gate) *
up`` itself, each rounded as the op-by-op composition rounds it (the twin is that composition).
Unfused, that is two unpacks, three products and the few-bit backward: about thirteen passes over
intermediate-size tensors, where the kernel reads grad_h and the packed buffers once and writes
its two or three outputs.
"""

from __future__ import annotations

import torch

from hf_actq.kernels.average_quant import _rows_per_tile, aq_dequantize, aq_values_tile
from hf_actq.kernels.fewbit import fewbit_backward, load_levels
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    TILE_ELEMENTS,
    cdiv,
    jit,
    tile,
    tl,
    to_dtype,
)

ROWS = TILE_ELEMENTS // 256
# 8 warps: 16 values a thread, whose three operands and two or three outputs fit the registers
# (at 4 warps sm_80 spilled).
OPTIONS = {**LAUNCH_OPTIONS, "num_warps": 8}


def gated_backward_reference(
    grad_h: torch.Tensor,
    a_data: torch.Tensor,
    a_mins: torch.Tensor,
    a_scales: torch.Tensor,
    up_data: torch.Tensor,
    up_mins: torch.Tensor,
    up_scales: torch.Tensor,
    codes: torch.Tensor,
    levels: torch.Tensor,
    nan_flag: torch.Tensor,
    a_codec: list[int],
    up_codec: list[int],
    bits: int,
    with_product: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_up, product)`` (product: an empty tensor unless ``with_product``).
    ``a_codec`` and ``up_codec``: each pack's ``[bits, group, block]``; both were packed from
    tensors of ``grad_h``'s shape and dtype, with the group dividing the last dim."""
    shape, dtype = list(grad_h.shape), grad_h.dtype
    a_hat = aq_dequantize(a_data, a_mins, a_scales, shape, dtype, *a_codec)
    up_hat = aq_dequantize(up_data, up_mins, up_scales, shape, dtype, *up_codec)
    grad_up = grad_h * a_hat
    grad_gate = fewbit_backward(grad_h * up_hat, codes, levels, nan_flag, bits)
    product = a_hat * up_hat if with_product else grad_h.new_empty(0)
    return grad_gate, grad_up, product


@jit
def gated_backward_kernel(
    grad_ptr,
    a_data_ptr,
    a_mins_ptr,
    a_scales_ptr,
    up_data_ptr,
    up_mins_ptr,
    up_scales_ptr,
    codes_ptr,
    levels_ptr,
    nan_flag_ptr,
    grad_gate_ptr,
    grad_up_ptr,
    product_ptr,
    n_elements,
    a_bytes,
    up_bytes,
    code_bytes,
    A_BITS: tl.constexpr,
    A_GROUP: tl.constexpr,
    A_BLOCK: tl.constexpr,
    A_ROWS: tl.constexpr,
    UP_BITS: tl.constexpr,
    UP_GROUP: tl.constexpr,
    UP_BLOCK: tl.constexpr,
    UP_ROWS: tl.constexpr,
    BITS: tl.constexpr,
    WITH_PRODUCT: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Every operand's tile is the same TILE_ELEMENTS consecutive elements: ROWS x 256 of the
    # gradient, A_ROWS blocks of A_BLOCK means of A_GROUP elements of act(gate), and so for up.
    first, count, local = tile(n_elements, ROWS, 256)
    valid = local < count
    dtype = grad_ptr.dtype.element_ty
    a = aq_values_tile(
        a_data_ptr,
        a_mins_ptr,
        a_scales_ptr,
        n_elements // A_GROUP,
        a_bytes,
        dtype,
        A_BITS,
        A_GROUP,
        A_BLOCK,
        A_ROWS,
    )
    a = tl.reshape(a, [ROWS, 256]).to(tl.float32)
    up = aq_values_tile(
        up_data_ptr,
        up_mins_ptr,
        up_scales_ptr,
        n_elements // UP_GROUP,
        up_bytes,
        dtype,
        UP_BITS,
        UP_GROUP,
        UP_BLOCK,
        UP_ROWS,
    )
    up = tl.reshape(up, [ROWS, 256]).to(tl.float32)
    grad = tl.load(grad_ptr + first + local, mask=valid, other=0.0).to(tl.float32)

    tl.store(grad_up_ptr + first + local, to_dtype(grad * a, dtype), mask=valid)
    if WITH_PRODUCT:
        tl.store(product_ptr + first + local, to_dtype(a * up, dtype), mask=valid)

    # The few-bit backward of grad * up, rounded first as the composition rounds it.
    grad_act = to_dtype(grad * up, dtype).to(tl.float32)
    level = load_levels(first, codes_ptr, code_bytes, levels_ptr, nan_flag_ptr, BITS, ROWS)
    tl.store(grad_gate_ptr + first + local, to_dtype(grad_act * level, dtype), mask=valid)


def gated_backward_triton(
    grad_h, a_data, a_mins, a_scales, up_data, up_mins, up_scales, codes, levels, nan_flag,
    a_codec, up_codec, bits, with_product,
):  # fmt: skip
    """The Triton side of :func:`gated_backward_reference`: one launch."""
    grad_h = grad_h.contiguous()
    n = grad_h.numel()
    grad_gate, grad_up = torch.empty_like(grad_h), torch.empty_like(grad_h)
    product = torch.empty_like(grad_h) if with_product else grad_h.new_empty(0)
    if n:
        (a_bits, a_group, a_block), (up_bits, up_group, up_block) = a_codec, up_codec
        gated_backward_kernel[(cdiv(n, TILE_ELEMENTS),)](
            grad_h,
            a_data,
            a_mins,
            a_scales,
            up_data,
            up_mins,
            up_scales,
            codes,
            levels,
            nan_flag,
            grad_gate,
            grad_up,
            product,
            n,
            a_data.numel(),
            up_data.numel(),
            codes.numel(),
            A_BITS=a_bits,
            A_GROUP=a_group,
            A_BLOCK=a_block,
            A_ROWS=_rows_per_tile(a_block, a_group),
            UP_BITS=up_bits,
            UP_GROUP=up_group,
            UP_BLOCK=up_block,
            UP_ROWS=_rows_per_tile(up_block, up_group),
            BITS=bits,
            WITH_PRODUCT=bool(with_product),
            ROWS=ROWS,
            **OPTIONS,
        )
    return grad_gate, grad_up, product


def _fake(grad_h, *args):
    with_product = args[-1]
    like = torch.empty_like(grad_h, memory_format=torch.contiguous_format)
    return (
        like,
        torch.empty_like(like),
        torch.empty_like(like) if with_product else grad_h.new_empty(0),
    )


gated_backward = register(
    "gated_backward",
    gated_backward_reference,
    gated_backward_triton,
    fake=_fake,
    takes=lambda grad_h, *_: grad_h.dtype in FLOATS,
)
