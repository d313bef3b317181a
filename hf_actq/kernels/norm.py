"""The backward of LayerNorm and RMSNorm from the normalized input (``ops/norm.py``):
``hf_actq::norm_backward``, ``grad_x = rstd * (g*w - centered * mean(g*w) - x_hat * mean(g*w *
x_hat))`` with the weight and bias gradients. The Triton kernels read ``grad_y`` and the decoded
``x_hat`` in their own dtype, with no fp32 temporaries in global memory; the twin works in fp32,
chunked over rows.

Two kernels, so that any width runs with one fixed column tile (one compiled variant per dtype,
not one per power of two): the first reduces each row to its two means, the second writes
``grad_x`` tile by tile and sums ``g * x_hat`` and ``g`` over a block of rows into per-block
partial weight and bias gradients, which the launcher adds up (a [blocks, width] fp32 tensor).
"""

from __future__ import annotations

import torch

from hf_actq.kernels.packing import row_chunks
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    cdiv,
    jit,
    tl,
    to_dtype,
)

BLOCK = 1024  # columns per tile
# At most this many row blocks, so the partial weight gradients stay small ([256, width] fp32)
# while a GPU still gets several programs per SM.
MAX_ROW_BLOCKS = 256


def norm_backward_reference(
    grad_y: torch.Tensor,
    x_hat: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    centered: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@jit
def norm_row_means_kernel(
    grad_ptr, xhat_ptr, w_ptr, means_ptr, width, inv_width, centered, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    sum_gw = tl.zeros([BLOCK], tl.float32)
    sum_gwx = tl.zeros([BLOCK], tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < width
        g = tl.load(grad_ptr + row * width + cols, mask=valid, other=0.0).to(tl.float32)
        x_hat = tl.load(xhat_ptr + row * width + cols, mask=valid, other=0.0).to(tl.float32)
        gw = g * tl.load(w_ptr + cols, mask=valid, other=0.0)
        sum_gw += gw
        sum_gwx += gw * x_hat
    # `centered` is 1.0 for LayerNorm (x_hat has zero mean) and 0.0 for RMSNorm.
    tl.store(means_ptr + 2 * row, tl.sum(sum_gw, axis=0) * inv_width * centered)
    tl.store(means_ptr + 2 * row + 1, tl.sum(sum_gwx, axis=0) * inv_width)


@jit
def norm_backward_kernel(
    grad_ptr,
    xhat_ptr,
    w_ptr,
    rstd_ptr,
    means_ptr,
    out_ptr,
    partial_w_ptr,
    partial_b_ptr,
    n_rows,
    width,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    row_block = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    w = tl.load(w_ptr + cols, mask=valid, other=0.0)
    sum_gx = tl.zeros([BLOCK], tl.float32)
    sum_g = tl.zeros([BLOCK], tl.float32)
    for r in range(0, rows_per_program):
        row = row_block * rows_per_program + r
        live = valid & ((cols * 0 + row) < n_rows)  # a vector mask: the interpreter wants one
        offsets = row * width + cols
        g = tl.load(grad_ptr + offsets, mask=live, other=0.0).to(tl.float32)
        x_hat = tl.load(xhat_ptr + offsets, mask=live, other=0.0).to(tl.float32)
        # A row past the end reads the last row's statistics (not a masked scalar load, which
        # the interpreter rejects); its g is zero and nothing of it is stored.
        last = tl.minimum(row, n_rows - 1)
        rstd = tl.load(rstd_ptr + last)
        mean_gw = tl.load(means_ptr + 2 * last)
        mean_gwx = tl.load(means_ptr + 2 * last + 1)
        grad_x = rstd * ((g * w - mean_gw) - x_hat * mean_gwx)
        tl.store(out_ptr + offsets, to_dtype(grad_x, out_ptr.dtype.element_ty), mask=live)
        sum_gx += g * x_hat
        sum_g += g
    tl.store(partial_w_ptr + row_block * width + cols, sum_gx, mask=valid)
    tl.store(partial_b_ptr + row_block * width + cols, sum_g, mask=valid)


def norm_backward_triton(grad_y, x_hat, rstd, weight, centered):
    """The Triton side of :func:`norm_backward_reference`."""
    width = grad_y.shape[-1]
    rows = grad_y.numel() // width if width else 0
    g = grad_y.reshape(rows, width).contiguous()
    # Mixed dtypes (an fp32 gradient over a half-precision x_hat) share the gradient's variant.
    x_hat = x_hat.reshape(rows, width).to(g.dtype).contiguous()
    rstd = rstd.reshape(rows).float().contiguous()
    if weight is None:
        w = torch.ones(width, dtype=torch.float32, device=g.device)
    else:
        w = weight.reshape(width).float().contiguous()
    grad_x = torch.empty_like(g)
    row_blocks = min(rows, MAX_ROW_BLOCKS)
    if rows == 0 or width == 0:
        zeros = torch.zeros(width, dtype=torch.float32, device=g.device)
        return grad_x.view(grad_y.shape), zeros, zeros.clone()
    rows_per_program = cdiv(rows, row_blocks)
    row_blocks = cdiv(rows, rows_per_program)
    means = torch.empty(rows, 2, dtype=torch.float32, device=g.device)
    partial_w = torch.empty(row_blocks, width, dtype=torch.float32, device=g.device)
    partial_b = torch.empty_like(partial_w)
    norm_row_means_kernel[(rows,)](
        g, x_hat, w, means, width, 1.0 / width, float(centered), BLOCK=BLOCK, **LAUNCH_OPTIONS
    )
    norm_backward_kernel[(row_blocks, cdiv(width, BLOCK))](
        g,
        x_hat,
        w,
        rstd,
        means,
        grad_x,
        partial_w,
        partial_b,
        rows,
        width,
        rows_per_program,
        BLOCK=BLOCK,
        **LAUNCH_OPTIONS,
    )
    return grad_x.view(grad_y.shape), partial_w.sum(0), partial_b.sum(0)


def _norm_backward_fake(grad_y, x_hat, rstd, weight, centered):
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
