"""The norm backward kernels under the Triton interpreter, against their PyTorch twin: the same
gradients up to summation order, for LayerNorm and RMSNorm, with and without a weight, at widths
that are not a multiple of the column tile and row counts that leave a partial row block."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_ACTQ_TEST_DEVICE") != "cuda":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported, or HF_ACTQ_TEST_DEVICE=cuda",
        allow_module_level=True,
    )

from hf_actq.kernels import norm as norm_kernels  # noqa: E402
from hf_actq.kernels.norm import norm_backward_reference  # noqa: E402


def _inputs(rows, width, dtype, centered):
    generator = torch.Generator(torch.get_default_device()).manual_seed(rows * 7919 + width)
    x = torch.randn(rows, width, generator=generator) * 3 + 1
    mean = x.mean(-1, keepdim=True) if centered else torch.zeros(rows, 1)
    rstd = torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
    x_hat = ((x - mean) * rstd).to(dtype)
    grad = torch.randn(rows, width, generator=generator).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    device = torch.get_default_device()
    return grad.to(device), x_hat.to(device), rstd.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_norm_backward_kernel_matches_its_twin(dtype, centered, with_weight, monkeypatch):
    # More rows than row blocks (two rows per program, the last block short) and a width of two
    # column tiles, the second partial.
    monkeypatch.setattr(norm_kernels, "MAX_ROW_BLOCKS", 8)
    rows, width = 15, norm_kernels.BLOCK + 37
    grad, x_hat, rstd, weight = _inputs(rows, width, dtype, centered)
    weight = weight if with_weight else None
    got = norm_kernels.norm_backward_triton(grad, x_hat, rstd, weight, centered)
    want = norm_backward_reference(grad, x_hat, rstd, weight, centered)
    assert got[0].dtype == dtype and got[0].shape == grad.shape
    # grad_x rounds once to the dtype from fp32 values equal up to summation order.
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=tolerance, atol=tolerance)
    for got_sum, want_sum in zip(got[1:], want[1:]):  # fp32 sums over 15 rows
        assert got_sum.dtype == torch.float32
        torch.testing.assert_close(got_sum, want_sum, rtol=1e-5, atol=1e-5)


def test_norm_backward_kernel_on_a_single_short_row_and_on_no_rows():
    grad, x_hat, rstd, weight = _inputs(1, 7, torch.float32, True)
    got = norm_kernels.norm_backward_triton(grad, x_hat, rstd, weight, True)
    want = norm_backward_reference(grad, x_hat, rstd, weight, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    empty = torch.empty(0, 7)
    grad_x, grad_w, grad_b = norm_kernels.norm_backward_triton(
        empty, empty, torch.empty(0, 1), weight, True
    )
    assert grad_x.shape == (0, 7) and not grad_w.any() and not grad_b.any()
