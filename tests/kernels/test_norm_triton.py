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


def _statistics(x, centered):
    """Per-row fp32 mean (None for an RMSNorm) and rstd of ``x``, as PyTorch's norms give them."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True) if centered else None
    rstd = torch.rsqrt((xf - (mean if centered else 0)).pow(2).mean(-1, keepdim=True) + 1e-5)
    return mean, rstd


# (name, centered, weight dtype or None, offset, fp32 scale): LayerNorm (its output is PyTorch's:
# none here), LLaMA's RMSNorm (w * x_hat, in the weight's and input's promoted dtype), Gemma's
# (1 + w) in fp32 and OLMo-2's and gpt-oss's w in fp32.
FORMS = [
    ("layer_norm", True, None, 0.0, False),
    ("rms_norm", False, "input", 0.0, False),
    ("rms_norm_fp32_weight", False, torch.float32, 0.0, False),
    ("gemma_rms_norm", False, "input", 1.0, True),
    ("fp32_scale_rms_norm", False, "input", 0.0, True),
]


# Tiles of 4096 elements that end mid-row, rows longer than a tile, rows of one element.
PACK_CASES = [
    ([4, 1, 128, 1], 5, 300),
    ([4, 1, 128, 1], 2, 4097),
    ([4, 1, 128, 1], 9, 1),
    ([3, 4, 64, 0], 5, 300),
    ([3, 4, 64, 0], 3, 4100),
    ([2, 16, 256, 1], 6, 304),
    ([2, 16, 256, 1], 2, 4112),
]


def _pack_cases():
    """Every case in fp32 and bf16 (four and eight values a 128-bit access) and fp16 (two bytes
    as bf16) on a short row and a row longer than a tile, for LayerNorm and RMSNorm; the other
    forms (their output's dtype and scale) on the short rows and one row longer than a tile:
    the tiles a long row spans are the same for every form (the interpreter takes 2 s a case)."""
    for form in FORMS:
        if form[0] == "fp32_scale_rms_norm":  # Gemma's path but for its offset: two cases
            for case in (PACK_CASES[0], PACK_CASES[3]):
                yield pytest.param(form, torch.bfloat16, *case, id=f"{form[0]}-{case}")
            continue
        every = form[0] in ("layer_norm", "rms_norm")
        cases = PACK_CASES if every else [c for c in PACK_CASES if c[2] < 4096] + PACK_CASES[1:2]
        for dtype in (torch.float32, torch.bfloat16):
            for case in cases:
                yield pytest.param(form, dtype, *case, id=f"{form[0]}-{dtype}-{case}")
        for case in (PACK_CASES[0], PACK_CASES[4]) if every else PACK_CASES[:1]:
            yield pytest.param(form, torch.float16, *case, id=f"{form[0]}-{torch.float16}-{case}")


@pytest.mark.parametrize("form,dtype,codec,rows,width", list(_pack_cases()))
def test_norm_pack_kernel_is_the_normalization_then_the_pack(form, dtype, codec, rows, width):
    """One launch gives x_hat's pack and an RMSNorm's output bit for bit as the twin's
    normalization followed by the codec's pack kernel, whatever the group."""
    from hf_actq.kernels.average_quant import aq_quantize_triton

    _, centered, weight_dtype, offset, fp32_scale = form
    generator = torch.Generator(torch.get_default_device()).manual_seed(rows * 31 + width)
    x = (torch.randn(rows, width, generator=generator) * 3 + 1).to(dtype)
    mean, rstd = _statistics(x, centered)
    weight = None
    if weight_dtype is not None:
        weight = torch.randn(width, generator=generator)
        weight = weight.to(dtype if weight_dtype == "input" else weight_dtype)
    got = norm_kernels.norm_pack_triton(x, mean, rstd, weight, offset, fp32_scale, codec, 99)
    x_hat, y = norm_kernels.normalized(x, mean, rstd, weight, offset, fp32_scale)
    bits, group, block, stochastic = codec
    want = aq_quantize_triton(x_hat.reshape(-1), group, bits, block, bool(stochastic), 99)
    for a, b in zip(got[1:], want, strict=True):
        assert torch.equal(a, b)
    if weight is None:
        assert got[0].numel() == 0
    else:
        assert got[0].dtype == y.dtype and torch.equal(got[0], y)
    if group == 1:  # the twin's pack is the kernel's bit for bit too (no group sums)
        twin = norm_kernels.norm_pack_reference(
            x, mean, rstd, weight, offset, fp32_scale, codec, 99
        )
        for a, b in zip(got, twin, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("codec", [[4, 1, 128], [3, 4, 64], [1, 2, 32]], ids=str)
def test_norm_backward_packed_dequantizes_inside_the_kernels(dtype, centered, codec, monkeypatch):
    """The backward from x_hat's pack equals the same kernels on the dequantized x_hat bit for bit,
    and the twin up to summation order."""
    from hf_actq.kernels.average_quant import aq_dequantize_triton, aq_quantize_triton

    monkeypatch.setattr(norm_kernels, "MAX_ROW_BLOCKS", 8)
    rows, width = 15, norm_kernels.BLOCK + 36
    grad, x_hat, rstd, weight = _inputs(rows, width, dtype, centered)
    bits, group, block = codec
    packs = aq_quantize_triton(x_hat.reshape(-1), group, bits, block, True, 7)
    got = norm_kernels.norm_backward_packed_triton(grad, *packs, codec, rstd, weight, centered)
    unpacked = aq_dequantize_triton(*packs, [rows, width], dtype, bits, group, block)
    want = norm_kernels.norm_backward_triton(grad, unpacked, rstd, weight, centered)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    twin = norm_kernels.norm_backward_packed_reference(grad, *packs, codec, rstd, weight, centered)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got[0], twin[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(got[1:], twin[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_norm_pack_and_packed_backward_on_no_rows():
    x = torch.empty(0, 8)
    y, *packs = norm_kernels.norm_pack_triton(
        x, None, torch.empty(0, 1), torch.ones(8), 0.0, False, [4, 1, 128, 1], 3
    )
    assert y.shape == (0, 8) and all(p.numel() == 0 for p in packs)
    grad_x, grad_w, grad_b = norm_kernels.norm_backward_packed_triton(
        x, *packs, [4, 1, 128], torch.empty(0, 1), torch.ones(8), False
    )
    assert grad_x.shape == (0, 8) and not grad_w.any() and not grad_b.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemmas_one_plus_w_is_added_inside_the_backward_kernels(dtype):
    """``offset`` 1 scales by ``1 + w`` in fp32 inside the kernels: the same gradients as the
    fp32 tensor ``w.float() + 1`` passed as the weight, bit for bit, and the twin's."""
    grad, x_hat, rstd, weight = _inputs(6, 300, dtype, centered=False)
    got = norm_kernels.norm_backward_triton(grad, x_hat, rstd, weight, False, 1.0)
    want = norm_kernels.norm_backward_triton(grad, x_hat, rstd, weight.float() + 1, False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    twin = norm_backward_reference(grad, x_hat, rstd, weight, False, 1.0)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got[0], twin[0], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got[1], twin[1], rtol=1e-5, atol=1e-5)


# (name, centered, weight dtype or None, bias, offset): a memory-sharing norm's forms.
OUTPUT_FORMS = [
    ("layer_norm", True, "input", True, 0.0),
    ("layer_norm_without_affine", True, None, False, 0.0),
    ("rms_norm", False, "input", False, 0.0),
    ("rms_norm_fp32_weight", False, torch.float32, False, 0.0),  # y in fp32
    ("gemma_rms_norm", False, "input", False, 1.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", OUTPUT_FORMS, ids=[f[0] for f in OUTPUT_FORMS])
def test_norm_backward_from_output_rebuilds_x_hat_inside_the_kernels(dtype, form, monkeypatch):
    """A memory-sharing norm's backward from its output: x_hat = (y - b) / (w + offset) rounded to
    y's dtype, the guard column's kept x_hat where the weight is zero, rebuilt inside both
    kernels; the same gradients as the kernels on the twin's rebuilt x_hat, bit for bit, and
    the twin's up to summation order."""
    name, centered, weight_dtype, has_bias, offset = form
    monkeypatch.setattr(norm_kernels, "MAX_ROW_BLOCKS", 8)
    rows, width = 15, norm_kernels.BLOCK + 36
    grad, x_hat, rstd, weight = _inputs(rows, width, dtype, centered)
    generator = torch.Generator(torch.get_default_device()).manual_seed(5)
    bias = torch.randn(width, generator=generator).to(dtype) if has_bias else None
    if weight_dtype is None:
        weight = index = columns = None
        y = x_hat if bias is None else (x_hat.float() + bias.float()).to(dtype)
    else:
        weight = weight.to(dtype if weight_dtype == "input" else weight_dtype)
        weight[width - 30] = -offset  # a zero scale: the guard column there (a later tile)
        y = (x_hat.float() * (weight.float() + offset)).to(torch.promote_types(dtype, weight.dtype))
        y = y if bias is None else (y.float() + bias.float()).to(y.dtype)
        index = torch.tensor([width - 30])
        columns = x_hat[:, width - 30 :][:, :1].clone()
    grad = grad.to(y.dtype)
    got = norm_kernels.norm_backward_from_output_triton(
        grad, y, weight, bias, index, columns, rstd, centered, offset
    )
    assert all(torch.isfinite(t).all() for t in got)
    rebuilt = norm_kernels.x_hat_from_output(y, weight, bias, offset, index, columns)
    want = norm_kernels.norm_backward_triton(grad, rebuilt, rstd, weight, centered, offset)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    twin = norm_kernels.norm_backward_from_output_reference(
        grad, y, weight, bias, index, columns, rstd, centered, offset
    )
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[y.dtype]
    torch.testing.assert_close(got[0], twin[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(got[1:], twin[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_norm_backward_from_output_on_no_rows():
    y = torch.empty(0, 8)
    grad_x, grad_w, grad_b = norm_kernels.norm_backward_from_output_triton(
        y, y, torch.ones(8), torch.zeros(8), torch.tensor([3]), torch.empty(0, 1),
        torch.empty(0, 1), True,
    )  # fmt: skip
    assert grad_x.shape == (0, 8) and not grad_w.any() and not grad_b.any()


@pytest.mark.parametrize("form", OUTPUT_FORMS, ids=[f[0] for f in OUTPUT_FORMS])
def test_norm_backward_from_output_keeps_non_finite_values_as_its_twin(form):
    """NaN and infinities in the kept output and in the gradient (a diverging step, an fp16
    overflow the scaler will skip) give the twin's non-finite pattern in every gradient: the
    kernels' row sums and column sums carry them as the twin's do, and a masked or guard-column
    lane does not hide them."""
    name, centered, weight_dtype, has_bias, offset = form
    rows, width = 12, norm_kernels.BLOCK + 36
    grad, x_hat, rstd, weight = _inputs(rows, width, torch.float32, centered)
    bias = torch.linspace(-1, 1, width) if has_bias else None
    index = columns = None
    if weight_dtype is not None:
        weight[7] = -offset
        index, columns = torch.tensor([7]), x_hat[:, 7:8].clone()
        columns[4] = float("nan")  # a NaN where only the guard column knows x_hat
    else:
        weight = None
    y = x_hat.clone()
    y[2, 5], y[6, width - 1], y[8, 9] = float("nan"), float("inf"), -float("inf")
    grad[10, 3] = float("nan")
    args = (grad, y, weight, bias, index, columns, rstd, centered, offset)
    got = norm_kernels.norm_backward_from_output_triton(*args)
    twin = norm_kernels.norm_backward_from_output_reference(*args)
    for a, b in zip(got, twin, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    bad_rows = [2, 6, 8, 10] + ([4] if index is not None else [])
    finite = torch.isfinite(got[0]).all(dim=-1)
    assert finite.tolist() == [row not in bad_rows for row in range(rows)]
