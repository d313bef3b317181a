"""The gated MLP's product ``act(gate) * up`` in one pass each way: ``hf_actq::gated_forward``
and ``hf_actq::gated_backward``, each a PyTorch twin and a Triton kernel.

Forward: from gate and up, the product (exactly PyTorch's: act(gate) rounded to the dtype, times
up), act's few-bit codes and NaN flag, and act(gate) and up packed by the uniform/AQ codec. The
composition it replaces (the few-bit forward, the product, two packs) reads or writes
intermediate-size tensors about seven times, the kernel three (gate and up read, the product
written), and act(gate) never exists in memory. The activation's value comes from the few-bit
kernel's formula where its probe found it equal to PyTorch's (``kernels/fewbit.py``); elsewhere
the composition runs.

Backward: from ``grad_h`` (the product's gradient), the packs and the codes, ``grad_gate =
act'(gate) * (grad_h * up)``, ``grad_up = grad_h * act(gate)`` and, where the down projection's
weight gradient needs it, the product itself, each rounded as the op-by-op composition rounds it
(two unpacks, three products and the few-bit backward: about thirteen passes, where the kernel
reads grad_h and the packed buffers once and writes its two or three outputs).

Every operand's tile is the same TILE_ELEMENTS consecutive elements (a codec's ROWS blocks of
BLOCK means of GROUP elements make TILE_ELEMENTS whatever its layout), so one program handles
each tile of every operand.
"""

from __future__ import annotations

import torch

from hf_actq.fewbit.activations import get_activation
from hf_actq.kernels.average_quant import (
    _rows_per_tile,
    aq_buffers,
    aq_dequantize,
    aq_quantize,
    aq_quantize_tile,
    aq_values_tile,
)
from hf_actq.kernels.compiled import mix_seed
from hf_actq.kernels.fewbit import (
    ACTIVATION_IDS,
    CODE_MODES,
    activation_value,
    exact_forward_options,
    fewbit_backward,
    fewbit_forward,
    load_levels,
    store_codes,
)
from hf_actq.kernels.packing import packed_nbytes
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    TILE_ELEMENTS,
    cdiv,
    jit,
    rows_and_columns,
    tile,
    tl,
    to_dtype,
)

ROWS = TILE_ELEMENTS // 256
# 8 warps: 16 values a thread, whose three operands and two or three outputs fit the registers
# (at 4 warps sm_80 spilled).
OPTIONS = {**LAUNCH_OPTIONS, "num_warps": 8}


def gated_forward_reference(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    borders: torch.Tensor,
    bits: int,
    params: list[float],
    a_codec: list[int],
    up_codec: list[int],
    seeds: list[int],
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """``(product, codes, nan_flag, *act(gate)'s pack, *up's pack)``: the few-bit forward of
    ``gate``, the product with ``up``, and both operands packed. ``a_codec`` and ``up_codec``:
    each pack's ``[bits, group, block, stochastic]``; ``seeds``: each pack's seed (operands of
    one shape, strides and dtype, contiguous or evenly spaced rows as the halves of one
    projection's output; the groups dividing the last dim). The outputs are contiguous."""
    activated, codes, nan_flag = fewbit_forward(gate, activation, borders, bits, params)
    product = activated * up
    packs = []
    for operand, (codec_bits, group, block, stochastic), seed in zip(
        (activated, up), (a_codec, up_codec), seeds, strict=True
    ):
        packs += aq_quantize(operand.reshape(-1), group, codec_bits, block, bool(stochastic), seed)
    return (product, codes, nan_flag, *packs)


@jit(do_not_specialize=["a_key", "up_key"])
def gated_forward_kernel(
    gate_ptr,
    up_ptr,
    product_ptr,
    codes_ptr,
    borders_ptr,
    nan_flag_ptr,
    a_data_ptr,
    a_mins_ptr,
    a_scales_ptr,
    up_data_ptr,
    up_mins_ptr,
    up_scales_ptr,
    n_elements,
    code_bytes,
    a_bytes,
    up_bytes,
    a_key,
    up_key,
    p0,
    p1,
    width,
    inv_width,
    row_stride,
    ACTIVATION: tl.constexpr,
    CODE_MODE: tl.constexpr,
    NUM_BORDERS: tl.constexpr,
    BITS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    A_STOCHASTIC: tl.constexpr,
    A_BITS: tl.constexpr,
    A_GROUP: tl.constexpr,
    A_BLOCK: tl.constexpr,
    A_ROWS: tl.constexpr,
    UP_STOCHASTIC: tl.constexpr,
    UP_BITS: tl.constexpr,
    UP_GROUP: tl.constexpr,
    UP_BLOCK: tl.constexpr,
    UP_ROWS: tl.constexpr,
    STRIDED: tl.constexpr,
    ROWS: tl.constexpr,
):
    first, count, local = tile(n_elements, ROWS, 256)
    valid = local < count
    dtype = gate_ptr.dtype.element_ty
    if STRIDED:
        # gate and up are rows of `width` elements `row_stride` apart (the halves of one
        # projection's output); everything written is contiguous. Runs of 8 elements never
        # cross a row (the launcher checks width and stride are multiples of 8): vector loads.
        row, column = rows_and_columns(first, local, width, inv_width)
        source = tl.max_contiguous(tl.multiple_of(row * row_stride + column, [1, 8]), [1, 8])
    else:
        source = first + local
    x = tl.load(gate_ptr + source, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + source, mask=valid, other=0.0).to(tl.float32)
    a = activation_value(x, p0, p1, ACTIVATION, dtype, LIBDEVICE)
    a = to_dtype(a, dtype).to(tl.float32)  # act(gate) as PyTorch returns it
    tl.store(product_ptr + first + local, to_dtype(a * up, dtype), mask=valid)
    store_codes(x, valid, first, local, borders_ptr, codes_ptr, nan_flag_ptr, code_bytes,
                CODE_MODE, NUM_BORDERS, BITS, ROWS)  # fmt: skip
    aq_quantize_tile(
        tl.reshape(a, [A_ROWS, A_BLOCK * A_GROUP]),
        tl.program_id(0),
        a_data_ptr,
        a_mins_ptr,
        a_scales_ptr,
        n_elements // A_GROUP,
        a_bytes,
        a_key,
        dtype,
        A_STOCHASTIC,
        A_BITS,
        A_GROUP,
        A_BLOCK,
        A_ROWS,
    )
    aq_quantize_tile(
        tl.reshape(up, [UP_ROWS, UP_BLOCK * UP_GROUP]),
        tl.program_id(0),
        up_data_ptr,
        up_mins_ptr,
        up_scales_ptr,
        n_elements // UP_GROUP,
        up_bytes,
        up_key,
        dtype,
        UP_STOCHASTIC,
        UP_BITS,
        UP_GROUP,
        UP_BLOCK,
        UP_ROWS,
    )


def gated_forward_triton(gate, up, activation, borders, bits, params, a_codec, up_codec, seeds):
    """The Triton side of :func:`gated_forward_reference`: one launch where the few-bit
    forward's output is exact without FMA contraction (the codecs' arithmetic must not be
    contracted either); the composition's launches otherwise."""
    options = exact_forward_options(activation, tuple(params), gate, borders, bits)
    if options is None or options["enable_fp_fusion"]:
        return gated_forward_reference(
            gate, up, activation, borders, bits, params, a_codec, up_codec, seeds
        )
    width = gate.shape[-1] if gate.dim() else 1
    stride = row_stride(gate)
    strided = not gate.is_contiguous()
    if strided and (stride is None or up.stride() != gate.stride() or width % 8 or stride % 8):
        return gated_forward_reference(
            gate, up, activation, borders, bits, params, a_codec, up_codec, seeds
        )
    n = gate.numel()
    spec = get_activation(activation)
    product = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=gate.device)
    nan_flag = torch.zeros(1, dtype=torch.int32, device=gate.device)
    packs, layout = [], {}
    for name, (codec_bits, group, block, stochastic), seed in zip(
        ("A", "UP"), (a_codec, up_codec), seeds, strict=True
    ):
        packs.append(aq_buffers(n // group, codec_bits, block, gate.device))
        layout |= {f"{name}_STOCHASTIC": bool(stochastic), f"{name}_BITS": codec_bits}
        layout |= {f"{name}_GROUP": group, f"{name}_BLOCK": block}
        layout[f"{name}_ROWS"] = _rows_per_tile(block, group)
        layout[f"{name.lower()}_key"] = mix_seed(seed) if stochastic else 0
    p0, p1 = (tuple(float(p) for p in params) + (0.0, 0.0))[:2]
    if n:
        gated_forward_kernel[(cdiv(n, TILE_ELEMENTS),)](
            gate,
            up,
            product,
            codes,
            borders,
            nan_flag,
            *packs[0],
            *packs[1],
            n,
            codes.numel(),
            packs[0][0].numel(),
            packs[1][0].numel(),
            p0=p0,
            p1=p1,
            width=width,
            inv_width=1.0 / width,
            row_stride=stride,
            ACTIVATION=ACTIVATION_IDS[spec.name],
            CODE_MODE=CODE_MODES[spec.code_mode],
            NUM_BORDERS=borders.numel(),
            BITS=bits,
            LIBDEVICE=gate.device.type == "cuda",
            STRIDED=strided,
            ROWS=ROWS,
            **layout,
            **options,
        )
    return (product, codes, nan_flag, *packs[0], *packs[1])


def row_stride(tensor: torch.Tensor) -> int | None:
    """The distance between consecutive rows of ``tensor`` seen as ``[rows, last dim]`` (its
    last dim where contiguous; a projection's chunk, ``gate_up.chunk(2, -1)``'s halves: twice
    that), or None where rows are not evenly spaced or the last dim is not contiguous."""
    if tensor.is_contiguous():
        return tensor.shape[-1] if tensor.dim() else 1
    if tensor.stride(-1) != 1 or tensor.dim() < 2:
        return None
    stride = spanned = tensor.stride(-2)
    spanned *= tensor.shape[-2]
    for dim in range(tensor.dim() - 3, -1, -1):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != spanned:
            return None
        spanned *= tensor.shape[dim]
    return stride


def _forward_fake(gate, up, activation, borders, bits, params, a_codec, up_codec, seeds):
    n = gate.numel()
    packs = []
    for codec_bits, group, block, _ in (a_codec, up_codec):
        means = n // group
        packs += [
            gate.new_empty(packed_nbytes(means, codec_bits), dtype=torch.uint8),
            gate.new_empty(-(-means // block), dtype=torch.float32),
            gate.new_empty(-(-means // block), dtype=torch.float32),
        ]
    codes = gate.new_empty(packed_nbytes(n, bits), dtype=torch.uint8)
    product = gate.new_empty(gate.shape)
    return (product, codes, gate.new_empty(1, dtype=torch.int32), *packs)


gated_forward = register(
    "gated_forward",
    gated_forward_reference,
    gated_forward_triton,
    fake=_forward_fake,
    takes=lambda gate, *_: gate.dtype in FLOATS,
)


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
        tl.program_id(0),
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
        tl.program_id(0),
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
