"""LayerNorm and RMSNorm around their packed normalized input (``ops/norm.py``).

``hf_actq::norm_pack`` (forward): from ``x`` and the per-row statistics PyTorch computed, the
normalized input ``x_hat = (x - mean) * rstd`` in ``x``'s dtype packed by the uniform/AQ codec
and, for an RMSNorm, its output (HF's ``w * x_hat``, or Gemma's ``x * rstd * (1 + w)`` in fp32):
one kernel that reads ``x`` once, where the composition writes and reads ``x_hat`` (and, for an
RMSNorm, fp32 temporaries and the output's product) in several passes. ``x_hat`` never exists in
memory. Bit for bit the composition (the twin): the statistics are PyTorch's, and each element's
arithmetic is the twin's, rounded as it rounds.

``hf_actq::norm_backward`` and ``hf_actq::norm_backward_packed`` (backward): ``grad_x = rstd *
(g*w - centered * mean(g*w) - x_hat * mean(g*w * x_hat))`` with the weight and bias gradients,
from ``x_hat`` or from its pack (dequantized inside the kernels: no full-size ``x_hat``).
``hf_actq::norm_backward_from_output``: the same from a memory-sharing norm's output ``y``, the
kernels rebuilding ``x_hat = (y - b) / (w + offset)`` (rounded to ``y``'s dtype, the guard
column's kept ``x_hat`` where the division is undefined), where the twin rebuilds a full-size
``x_hat`` op by op (about ten device ops and fp32 chunk temporaries). The
Triton kernels read ``grad_y`` and ``x_hat`` in their own dtype, with no fp32 temporaries in
global memory; the twin works in fp32, chunked over rows.

Two backward kernels, so that any width runs with one fixed column tile (one compiled variant
per dtype, not one per power of two): the first reduces each row to its two means, the second
writes ``grad_x`` tile by tile and sums ``g * x_hat`` and ``g`` over a block of rows into
per-block partial weight and bias gradients, which the launcher adds up (a [2, blocks, width]
fp32 tensor).
"""

from __future__ import annotations

import torch

from hf_actq.kernels.average_quant import (
    _rows_per_tile,
    aq_buffers,
    aq_dequantize,
    aq_quantize,
    aq_quantize_tile,
)
from hf_actq.kernels.compiled import mix_seed
from hf_actq.kernels.packing import packed_nbytes, row_chunks
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    TILE_ELEMENTS,
    cdiv,
    jit,
    load_codes,
    rows_and_columns,
    tile,
    tl,
    to_dtype,
)

BLOCK = 1024  # columns per tile of the backward kernels
# At most this many row blocks, so the partial weight gradients stay small ([256, width] fp32)
# while a GPU still gets several programs per SM.
MAX_ROW_BLOCKS = 256
ROWS = TILE_ELEMENTS // 256  # the forward kernel's tile: ROWS x 256 consecutive elements


def fp32_scale_of(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """What an fp32-scaled RMSNorm multiplies ``x_hat`` by: ``weight + offset`` in fp32 (Gemma's
    ``1 + w``), the weight itself where the offset is 0 (no ``+ 0.0``, which turns -0 into +0)."""
    return weight.float() + offset if offset else weight.float()


def normalized(x, mean, rstd, weight=None, offset=0.0, fp32_scale=False):
    """``(x_hat, y)``: ``x_hat = (x - mean) * rstd`` (``mean`` None: ``x * rstd``, an RMSNorm)
    computed in fp32 and rounded to ``x``'s dtype, and with a ``weight`` RMSNorm's output: HF's
    ``weight * x_hat`` (LLaMA's) or, with ``fp32_scale``, ``(x * rstd * (weight + offset))`` in
    fp32 rounded to ``x``'s dtype (Gemma's, offset 1; OLMo-2's and gpt-oss's, offset 0); else
    None. A chunk of rows at a time: never a full-size fp32 copy of a half-precision input."""
    width = x.shape[-1]
    rows_x = x.reshape(-1, width)
    rstd = rstd.reshape(-1, 1)
    mean = None if mean is None else mean.reshape(-1, 1)
    x_hat = torch.empty(rows_x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty_like(x_hat) if weight is not None and fp32_scale else None
    scale = None if y is None else fp32_scale_of(weight, offset)
    for rows in row_chunks(rows_x.shape[0], width):
        hidden = rows_x[rows].float()
        if mean is not None:
            hidden = hidden - mean[rows]
        hidden = hidden * rstd[rows]
        x_hat[rows] = hidden
        if y is not None:
            y[rows] = hidden * scale
    x_hat = x_hat.view(x.shape)
    if weight is None:
        return x_hat, None
    return x_hat, (y.view(x.shape) if y is not None else weight * x_hat)


def norm_pack_reference(
    x: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    offset: float,
    fp32_scale: bool,
    codec: list[int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, *x_hat's pack)``: :func:`normalized` of a contiguous ``x`` with its per-row fp32
    ``mean`` (None: an RMSNorm) and ``rstd``, ``x_hat`` packed by the uniform/AQ codec ``codec``
    (``[bits, group, block, stochastic]``, the group dividing the last dim) with ``seed``; ``y``
    is an empty tensor without a ``weight`` (LayerNorm's output is PyTorch's own)."""
    x_hat, y = normalized(x, mean, rstd, weight, offset, fp32_scale)
    bits, group, block, stochastic = codec
    packs = aq_quantize(x_hat.reshape(-1), group, bits, block, bool(stochastic), seed)
    return (x.new_empty(0) if y is None else y), *packs


@jit(do_not_specialize=["key"])
def norm_pack_kernel(
    x_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    y_ptr,
    data_ptr,
    mins_ptr,
    scales_ptr,
    n_elements,
    width,
    inv_width,
    n_bytes,
    key,
    offset,
    CENTERED: tl.constexpr,
    WITH_OUTPUT: tl.constexpr,
    OFFSET_FORM: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    CODEC_ROWS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # The tile is ROWS x 256 consecutive elements, which are also the codec's CODEC_ROWS blocks
    # of BLOCK means of GROUP elements: each element's statistics by its row (gathered; a row's
    # are shared by its elements and stay in cache).
    first, count, local = tile(n_elements, ROWS, 256)
    valid = local < count
    dtype = x_ptr.dtype.element_ty
    row, column = rows_and_columns(first, local, width, inv_width)
    hidden = tl.load(x_ptr + first + local, mask=valid, other=0.0).to(tl.float32)
    if CENTERED:
        hidden = hidden - tl.load(mean_ptr + row, mask=valid, other=0.0)
    hidden = hidden * tl.load(rstd_ptr + row, mask=valid, other=0.0)
    x_hat = to_dtype(hidden, dtype).to(tl.float32)
    if WITH_OUTPUT:
        w = tl.load(w_ptr + column, mask=valid, other=0.0).to(tl.float32)
        if offset != 0.0:  # Gemma's 1 + w; OLMo-2's and gpt-oss's scale by w itself
            w += offset
        y = hidden * w if OFFSET_FORM else w * x_hat
        tl.store(y_ptr + first + local, to_dtype(y, y_ptr.dtype.element_ty), mask=valid)
    aq_quantize_tile(
        tl.reshape(x_hat, [CODEC_ROWS, BLOCK * GROUP]),
        tl.program_id(0),
        data_ptr,
        mins_ptr,
        scales_ptr,
        n_elements // GROUP,
        n_bytes,
        key,
        dtype,
        STOCHASTIC,
        BITS,
        GROUP,
        BLOCK,
        CODEC_ROWS,
    )


def norm_pack_triton(x, mean, rstd, weight, offset, fp32_scale, codec, seed):
    """The Triton side of :func:`norm_pack_reference`: one launch."""
    bits, group, block, stochastic = codec
    n, width = x.numel(), x.shape[-1]
    packs = aq_buffers(n // group, bits, block, x.device)
    with_output = weight is not None
    if with_output:
        y_dtype = x.dtype if fp32_scale else torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    else:
        y = x.new_empty(0)
    if n:
        norm_pack_kernel[(cdiv(n, TILE_ELEMENTS),)](
            x,
            rstd if mean is None else mean,
            rstd,
            weight if with_output else rstd,
            y if with_output else x,
            *packs,
            n,
            width,
            1.0 / width,
            packs[0].numel(),
            mix_seed(seed) if stochastic else 0,
            float(offset),
            CENTERED=mean is not None,
            WITH_OUTPUT=with_output,
            OFFSET_FORM=bool(fp32_scale),
            STOCHASTIC=bool(stochastic),
            BITS=bits,
            GROUP=group,
            BLOCK=block,
            CODEC_ROWS=_rows_per_tile(block, group),
            ROWS=ROWS,
            **LAUNCH_OPTIONS,
        )
    return y, *packs


def _norm_pack_fake(x, mean, rstd, weight, offset, fp32_scale, codec, seed):
    bits, group, block, _ = codec
    means = x.numel() // group
    if weight is None:
        y = x.new_empty(0)
    else:
        y_dtype = x.dtype if fp32_scale else torch.promote_types(weight.dtype, x.dtype)
        y = x.new_empty(x.shape, dtype=y_dtype)
    return (
        y,
        x.new_empty(packed_nbytes(means, bits), dtype=torch.uint8),
        x.new_empty(-(-means // block), dtype=torch.float32),
        x.new_empty(-(-means // block), dtype=torch.float32),
    )


norm_pack = register(
    "norm_pack",
    norm_pack_reference,
    norm_pack_triton,
    fake=_norm_pack_fake,
    takes=lambda x, *_: x.dtype in FLOATS,
)


def norm_backward_reference(
    grad_y: torch.Tensor,
    x_hat: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    centered: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of LayerNorm (``centered``) or RMSNorm from the normalized input ``x_hat`` and the
    per-row ``rstd``: ``grad_x`` in ``grad_y``'s dtype, and the fp32 weight and bias gradients
    (``sum g * x_hat`` and ``sum g`` over rows). The norm scales by ``weight + offset`` (Gemma's
    ``1 + w``) in fp32. fp32 arithmetic, chunked over rows."""
    width = grad_y.shape[-1]
    grad = grad_y.reshape(-1, width)
    x_hat = x_hat.reshape(-1, width)
    rstd = rstd.reshape(-1, 1)
    w = None if weight is None else weight.float()
    w = w + offset if w is not None and offset else w
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


def norm_backward_packed_reference(
    grad_y: torch.Tensor,
    data: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    codec: list[int],
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    centered: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`norm_backward_reference` with ``x_hat`` given as its uniform/AQ pack (``codec``:
    ``[bits, group, block]``; packed from a tensor of ``grad_y``'s shape and dtype, the group
    dividing the last dim)."""
    bits, group, block = codec
    shape = list(grad_y.shape)
    x_hat = aq_dequantize(data, mins, scales, shape, grad_y.dtype, bits, group, block)
    return norm_backward_reference(grad_y, x_hat, rstd, weight, centered, offset)


def x_hat_from_output(y, weight, bias, offset=0.0, guard_index=None, guard_columns=None):
    """A memory-sharing norm's ``x_hat`` rebuilt from its output: ``(y - bias) / (weight +
    offset)`` in ``y``'s dtype, computed in fp32 a chunk of rows at a time, but in the columns
    ``guard_index`` (those of the smallest ``|weight + offset|``, where the division is undefined
    or loses the most), which take ``guard_columns`` (``[rows, K]``, x_hat kept there by the
    forward)."""
    width = y.shape[-1]
    rows_y = y.reshape(-1, width)
    x_hat = torch.empty(rows_y.shape, dtype=y.dtype, device=y.device)
    for rows in row_chunks(rows_y.shape[0], width):
        value = rows_y[rows].float()
        if bias is not None:
            value = value - bias.float()
        x_hat[rows] = value if weight is None else value / (weight.float() + offset)
    if guard_index is not None:
        columns = guard_columns.reshape(-1, guard_index.numel()).to(x_hat.dtype)
        x_hat.index_copy_(1, guard_index, columns)
    return x_hat.view(y.shape)


def norm_backward_from_output_reference(
    grad_y: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    guard_index: torch.Tensor | None,
    guard_columns: torch.Tensor | None,
    rstd: torch.Tensor,
    centered: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`norm_backward_reference` of a memory-sharing norm, which kept its output ``y``:
    ``x_hat`` rebuilt by :func:`x_hat_from_output` with its guard columns."""
    x_hat = x_hat_from_output(y, weight, bias, offset, guard_index, guard_columns)
    return norm_backward_reference(grad_y, x_hat, rstd, weight, centered, offset)


@jit
def rebuilt_x_hat(
    y_ptr,
    bias_ptr,
    w_divisor,
    guard_column,
    guard_value,
    offsets,
    cols,
    valid,
    HAS_BIAS: tl.constexpr,
):
    """:func:`x_hat_from_output` at ``offsets`` (columns ``cols``) in fp32, rounded to ``y``'s
    dtype as the twin rounds it; ``guard_value`` in the column ``guard_column`` (-1: none)."""
    value = tl.load(y_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        value -= tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    # IEEE division, as the twin's (Triton's fp32 `/` is approximate on NVIDIA GPUs).
    x_hat = to_dtype(tl.math.div_rn(value, w_divisor), y_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(cols == guard_column, guard_value, x_hat)


@jit
def load_x_hat(
    xhat_ptr,
    data_ptr,
    mins_ptr,
    scales_ptr,
    offsets,
    valid,
    n_bytes,
    PACKED: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    CODEC_BLOCK: tl.constexpr,
):
    """x_hat at ``offsets`` (int64) in fp32: loaded, or dequantized from its pack as the AQ
    twin dequantizes (the code of the element's mean, times its block's scale, plus its
    minimum, rounded to the dtype)."""
    if PACKED:
        mean = offsets // GROUP  # constants: shifts
        code = load_codes(data_ptr, mean, valid, BITS, n_bytes).to(tl.float32)
        block = mean // CODEC_BLOCK
        lo = tl.load(mins_ptr + block, mask=valid, other=0.0)
        scale = tl.load(scales_ptr + block, mask=valid, other=0.0)
        return to_dtype(code * scale + lo, xhat_ptr.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(xhat_ptr + offsets, mask=valid, other=0.0).to(tl.float32)


@jit
def load_weight(w_ptr, w_offset, cols, valid):
    """The weight at ``cols`` in fp32, plus ``w_offset`` (Gemma's 1 + w) where it is not zero:
    adding zero would turn a -0.0 weight into 0.0."""
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if w_offset != 0.0:
        w += w_offset
    return w


@jit
def load_guard_column(guard_index_ptr, GUARD: tl.constexpr):
    """A memory-sharing norm's guard column (-1: no guard, a norm without weight)."""
    if GUARD:
        return tl.load(guard_index_ptr)
    else:
        return -1


@jit
def load_guard_value(guard_ptr, row, Y_DTYPE: tl.constexpr, GUARD: tl.constexpr):
    """``row``'s kept x_hat in the guard column, rounded to ``Y_DTYPE`` as the twin copies it
    into x_hat."""
    if GUARD:
        return to_dtype(tl.load(guard_ptr + row).to(tl.float32), Y_DTYPE).to(tl.float32)
    else:
        return 0.0


@jit
def norm_row_means_kernel(
    grad_ptr,
    xhat_ptr,
    data_ptr,
    mins_ptr,
    scales_ptr,
    w_ptr,
    w_offset,
    bias_ptr,
    guard_index_ptr,
    guard_ptr,
    means_ptr,
    width,
    inv_width,
    centered,
    n_bytes,
    PACKED: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    CODEC_BLOCK: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GUARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sum_gw = tl.zeros([BLOCK], tl.float32)
    sum_gwx = tl.zeros([BLOCK], tl.float32)
    if FROM_OUTPUT:
        guard_column = load_guard_column(guard_index_ptr, GUARD)
        guard_value = load_guard_value(guard_ptr, row, xhat_ptr.dtype.element_ty, GUARD)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < width
        g = tl.load(grad_ptr + row * width + cols, mask=valid, other=0.0).to(tl.float32)
        if FROM_OUTPUT:  # xhat_ptr holds the norm's output y
            divisor = tl.load(w_ptr + cols, mask=valid, other=1.0).to(tl.float32) + w_offset
            x_hat = rebuilt_x_hat(xhat_ptr, bias_ptr, divisor, guard_column, guard_value,
                                  row * width + cols, cols, valid, HAS_BIAS)  # fmt: skip
        else:
            x_hat = load_x_hat(xhat_ptr, data_ptr, mins_ptr, scales_ptr, row * width + cols,
                               valid, n_bytes, PACKED, BITS, GROUP, CODEC_BLOCK)  # fmt: skip
        gw = g * load_weight(w_ptr, w_offset, cols, valid)
        sum_gw += gw
        sum_gwx += gw * x_hat
    # `centered` is 1.0 for LayerNorm (x_hat has zero mean) and 0.0 for RMSNorm.
    tl.store(means_ptr + 2 * row, tl.sum(sum_gw, axis=0) * inv_width * centered)
    tl.store(means_ptr + 2 * row + 1, tl.sum(sum_gwx, axis=0) * inv_width)


@jit
def norm_backward_kernel(
    grad_ptr,
    xhat_ptr,
    data_ptr,
    mins_ptr,
    scales_ptr,
    w_ptr,
    w_offset,
    bias_ptr,
    guard_index_ptr,
    guard_ptr,
    rstd_ptr,
    means_ptr,
    out_ptr,
    partial_ptr,
    n_rows,
    width,
    rows_per_program,
    row_blocks,
    n_bytes,
    PACKED: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    CODEC_BLOCK: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GUARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row_block = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    w = load_weight(w_ptr, w_offset, cols, valid)
    if FROM_OUTPUT:  # the twin divides by weight + offset even where the offset is 0
        divisor = tl.load(w_ptr + cols, mask=valid, other=1.0).to(tl.float32) + w_offset
        guard_column = load_guard_column(guard_index_ptr, GUARD)
    sum_gx = tl.zeros([BLOCK], tl.float32)
    sum_g = tl.zeros([BLOCK], tl.float32)
    for r in range(0, rows_per_program):
        row = row_block * rows_per_program + r
        live = valid & ((cols * 0 + row) < n_rows)  # a vector mask: the interpreter wants one
        offsets = row * width + cols
        g = tl.load(grad_ptr + offsets, mask=live, other=0.0).to(tl.float32)
        # A row past the end reads the last row's statistics (not a masked scalar load, which
        # the interpreter rejects); its g is zero and nothing of it is stored.
        last = tl.minimum(row, n_rows - 1)
        if FROM_OUTPUT:  # xhat_ptr holds the norm's output y
            guard_value = load_guard_value(guard_ptr, last, xhat_ptr.dtype.element_ty, GUARD)
            x_hat = rebuilt_x_hat(xhat_ptr, bias_ptr, divisor, guard_column, guard_value,
                                  offsets, cols, live, HAS_BIAS)  # fmt: skip
        else:
            x_hat = load_x_hat(xhat_ptr, data_ptr, mins_ptr, scales_ptr, offsets, live, n_bytes,
                               PACKED, BITS, GROUP, CODEC_BLOCK)  # fmt: skip
        rstd = tl.load(rstd_ptr + last)
        mean_gw = tl.load(means_ptr + 2 * last)
        mean_gwx = tl.load(means_ptr + 2 * last + 1)
        grad_x = rstd * ((g * w - mean_gw) - x_hat * mean_gwx)
        tl.store(out_ptr + offsets, to_dtype(grad_x, out_ptr.dtype.element_ty), mask=live)
        sum_gx += g * x_hat
        sum_g += g
    # Partial weight gradients, then partial bias gradients: [2, row_blocks, width].
    tl.store(partial_ptr + row_block * width + cols, sum_gx, mask=valid)
    tl.store(partial_ptr + (row_blocks + row_block) * width + cols, sum_g, mask=valid)


def _norm_backward_launch(g, x_hat, packed, rstd, weight, centered, offset, output=None):
    """Both kernels on ``g`` ([rows, width], contiguous) and ``x_hat`` (the same, in ``g``'s
    dtype) or ``packed`` (``(data, mins, scales, [bits, group, block])`` of x_hat in ``g``'s
    dtype, in its place) or ``output`` (``(y, bias, guard_index, guard_columns)`` of a
    memory-sharing norm, ``y`` like ``g``, x_hat rebuilt in the kernels). The weight is read in
    its own dtype, ``offset`` added in fp32."""
    rows, width = g.shape
    rstd = rstd.reshape(rows).float().contiguous()
    if weight is None:
        w, offset = torch.ones(width, dtype=torch.float32, device=g.device), 0.0
    else:
        w = weight.reshape(width).contiguous()
    grad_x = torch.empty_like(g)
    if rows == 0 or width == 0:
        zeros = torch.zeros(2, width, dtype=torch.float32, device=g.device)
        return grad_x, zeros[0], zeros[1]
    # Unused pointers of the other forms: tensors that are there, in the signature's dtypes.
    bias, guard_index, guard_columns = None, None, None
    if output is not None:
        x_hat, bias, guard_index, guard_columns = output
    if packed is None:
        data, mins, scales = x_hat.view(torch.uint8), rstd, rstd
        bits, group, codec_block = 8, 1, 32
    else:
        (data, mins, scales, (bits, group, codec_block)), x_hat = packed, g
    layout = {"PACKED": packed is not None, "BITS": bits, "GROUP": group}
    layout["CODEC_BLOCK"] = codec_block
    layout["FROM_OUTPUT"] = output is not None
    layout["HAS_BIAS"], layout["GUARD"] = bias is not None, guard_index is not None
    rows_per_program = cdiv(rows, min(rows, MAX_ROW_BLOCKS))
    row_blocks = cdiv(rows, rows_per_program)
    means = torch.empty(rows, 2, dtype=torch.float32, device=g.device)
    partial = torch.empty(2, row_blocks, width, dtype=torch.float32, device=g.device)
    operands = (g, x_hat, data, mins, scales, w, float(offset))
    operands += (
        x_hat if bias is None else bias,
        rstd if guard_index is None else guard_index,
        x_hat if guard_columns is None else guard_columns,
    )
    norm_row_means_kernel[(rows,)](
        *operands, means, width, 1.0 / width, float(centered), data.numel(), **layout,
        BLOCK=BLOCK, **LAUNCH_OPTIONS,
    )  # fmt: skip
    norm_backward_kernel[(row_blocks, cdiv(width, BLOCK))](
        *operands, rstd, means, grad_x, partial, rows, width, rows_per_program, row_blocks,
        data.numel(), **layout, BLOCK=BLOCK, **LAUNCH_OPTIONS,
    )  # fmt: skip
    grad_w, grad_b = partial.sum(1)
    return grad_x, grad_w, grad_b


def norm_backward_triton(grad_y, x_hat, rstd, weight, centered, offset=0.0):
    """The Triton side of :func:`norm_backward_reference`."""
    width = grad_y.shape[-1]
    rows = grad_y.numel() // width if width else 0
    g = grad_y.reshape(rows, width).contiguous()
    # Mixed dtypes (an fp32 gradient over a half-precision x_hat) share the gradient's variant.
    x_hat = x_hat.reshape(rows, width).to(g.dtype).contiguous()
    grad_x, grad_w, grad_b = _norm_backward_launch(g, x_hat, None, rstd, weight, centered, offset)
    return grad_x.view(grad_y.shape), grad_w, grad_b


def norm_backward_packed_triton(
    grad_y, data, mins, scales, codec, rstd, weight, centered, offset=0.0
):
    """The Triton side of :func:`norm_backward_packed_reference`: x_hat dequantized inside both
    kernels."""
    width = grad_y.shape[-1]
    rows = grad_y.numel() // width if width else 0
    g = grad_y.reshape(rows, width).contiguous()
    packed = (data, mins, scales, codec)
    args = (rstd, weight, centered, offset)
    grad_x, grad_w, grad_b = _norm_backward_launch(g, None, packed, *args)
    return grad_x.view(grad_y.shape), grad_w, grad_b


def norm_backward_from_output_triton(
    grad_y, y, weight, bias, guard_index, guard_columns, rstd, centered, offset=0.0
):
    """The Triton side of :func:`norm_backward_from_output_reference`: x_hat rebuilt from ``y``
    inside both kernels (no full-size x_hat, no fp32 temporaries, one launch each)."""
    width = grad_y.shape[-1]
    rows = grad_y.numel() // width if width else 0
    g = grad_y.reshape(rows, width).contiguous()
    y = y.reshape(rows, width).contiguous()
    if guard_index is not None:
        guard_columns = guard_columns.reshape(rows).contiguous()
    output = (y, bias, guard_index, guard_columns)
    grad_x, grad_w, grad_b = _norm_backward_launch(
        g, None, None, rstd, weight, centered, offset, output
    )
    return grad_x.view(grad_y.shape), grad_w, grad_b


def _takes_from_output(grad_y, y, weight, bias, guard_index, *_):
    """The kernels rebuild x_hat in ``y``'s dtype, which must be the gradient's (autograd gives
    an output's gradient its dtype), and take one guard column."""
    return (
        grad_y.dtype in FLOATS
        and y.dtype == grad_y.dtype
        and (guard_index is None or guard_index.numel() == 1)
    )


def _norm_backward_fake(grad_y, *args):
    width = grad_y.shape[-1]
    return (
        torch.empty_like(grad_y, memory_format=torch.contiguous_format),
        grad_y.new_empty(width, dtype=torch.float32),
        grad_y.new_empty(width, dtype=torch.float32),
    )


norm_backward = register(
    "norm_backward",
    norm_backward_reference,
    norm_backward_triton,
    fake=_norm_backward_fake,
    takes=lambda grad_y, *_: grad_y.dtype in FLOATS,
)
norm_backward_from_output = register(
    "norm_backward_from_output",
    norm_backward_from_output_reference,
    norm_backward_from_output_triton,
    fake=_norm_backward_fake,
    takes=_takes_from_output,
)
norm_backward_packed = register(
    "norm_backward_packed",
    norm_backward_packed_reference,
    norm_backward_packed_triton,
    fake=_norm_backward_fake,
    takes=lambda grad_y, *_: grad_y.dtype in FLOATS,
)
