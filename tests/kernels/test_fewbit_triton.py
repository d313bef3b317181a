"""Triton kernels under the interpreter (TRITON_INTERPRET=1, set in conftest) against their twins.

Packed codes, NaN flags and gradients must be bit-identical. The kernel's own output under the
interpreter is Triton math (a GPU computes it with CUDA's math library, as PyTorch does) and may
differ in rounding: the bound checked is |dy| <= 4 * eps(dtype) * max(1, |x|). The ops use that
output only where a probe found it equal to PyTorch's on every probed input (tested here with the
probe run on the CPU; on a GPU by tests/test_cuda.py's kernel run).
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_ACTQ_TEST_DEVICE") != "cuda":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported, or HF_ACTQ_TEST_DEVICE=cuda",
        allow_module_level=True,
    )

from hf_actq.fewbit import ACTIVATIONS, table_for  # noqa: E402
from hf_actq.kernels import fewbit, fewbit_forward, kernels_on_cpu  # noqa: E402
from hf_actq.kernels.fewbit import (  # noqa: E402
    ACTIVATION_IDS,
    fewbit_backward_reference,
    fewbit_backward_triton,
    fewbit_forward_reference,
    fewbit_forward_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ON_GPU = os.environ.get("HF_ACTQ_TEST_DEVICE") == "cuda"
# The probe on the CPU compares the interpreter's Triton math with PyTorch's CPU kernels.
cpu_probe = pytest.mark.skipif(ON_GPU, reason="the probe of the interpreter's Triton math")
PIECEWISE_LINEAR = {"relu", "leaky_relu", "relu6", "hardtanh", "hardsigmoid", "hardswish"}


def _case(name, bits, dtype, n=4109):
    spec = ACTIVATIONS[name]
    table = table_for(name, bits)
    torch.manual_seed(n + bits)
    x = (torch.randn(n) * 4).to(dtype)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-7, -1e-30, 30.0, -6.0])
    borders = torch.tensor(table.borders, dtype=torch.float32)
    levels = torch.tensor(table.levels, dtype=torch.float32)
    return x, borders, levels, table.bits, tuple(spec.params.values())


def test_every_activation_has_a_kernel():
    assert set(ACTIVATION_IDS) == set(ACTIVATIONS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_forward_kernel_matches_twin(name, dtype):
    for bits in (1, 3, 4) if ACTIVATIONS[name].exact is None else (1,):
        x, borders, levels, bits, params = _case(name, bits, dtype)
        y_t, packed_t, flag_t = fewbit_forward_triton(x, name, borders, bits, params)
        y_r, packed_r, flag_r = fewbit_forward_reference(x, name, borders, bits, params)
        assert torch.equal(packed_t, packed_r)
        assert torch.equal(flag_t, flag_r) and flag_t.item() == 0
        finite = torch.isfinite(x)
        diff = (y_t.float() - y_r.float())[finite].abs()
        if name in PIECEWISE_LINEAR:
            assert diff.max().item() == 0
        else:
            bound = 4 * torch.finfo(dtype).eps * x.float()[finite].abs().clamp_min(1)
            assert (diff <= bound).all(), (diff / bound).max()
        assert torch.equal(y_t[finite].isnan(), y_r[finite].isnan())
        # Codes only (as the ops launch it): the same codes and flag, no output.
        none, packed_c, flag_c = fewbit_forward_triton(x, name, borders, bits, params, False)
        assert none is None and torch.equal(packed_c, packed_r) and torch.equal(flag_c, flag_r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_backward_kernel_matches_twin(bits, dtype):
    x, borders, levels, bits, params = _case("gelu", bits, dtype)
    _, packed, flag = fewbit_forward_reference(x, "gelu", borders, bits)
    grad = torch.randn(x.shape).to(dtype)
    got = fewbit_backward_triton(grad, packed, levels, flag, bits)
    assert torch.equal(got, fewbit_backward_reference(grad, packed, levels, flag, bits))


@pytest.mark.parametrize("n", [0, 1, 7, 2047, 2048, 2049, 5000])
def test_sizes_across_program_boundaries(n):
    x, borders, levels, bits, params = _case("silu", 3, torch.float32, n=max(n, 8))
    x = x[:n]
    y_t, packed_t, flag_t = fewbit_forward_triton(x, "silu", borders, bits)
    y_r, packed_r, flag_r = fewbit_forward_reference(x, "silu", borders, bits)
    assert torch.equal(packed_t, packed_r) and packed_t.numel() == (3 * n + 7) // 8
    grad = torch.randn(n)
    assert torch.equal(
        fewbit_backward_triton(grad, packed_t, levels, flag_t, bits),
        fewbit_backward_reference(grad, packed_r, levels, flag_r, bits),
    )


def test_nan_flag_and_non_contiguous_input():
    x, borders, levels, bits, params = _case("tanh", 2, torch.float32)
    x = x.view(-1, 7)[:, :5].t()  # non-contiguous view
    assert not x.is_contiguous()
    x[2, 3] = float("nan")
    y_t, packed_t, flag_t = fewbit_forward_triton(x, "tanh", borders, bits)
    y_r, packed_r, flag_r = fewbit_forward_reference(x, "tanh", borders, bits)
    assert torch.equal(packed_t, packed_r) and flag_t.item() == 1 and flag_r.item() == 1
    grad = torch.ones_like(x)
    assert fewbit_backward_triton(grad, packed_t, levels, flag_t, bits).isnan().all()


@pytest.fixture
def probed_on_cpu(monkeypatch):
    """The fused forward probed on the CPU (the interpreter's Triton math in place of CUDA's),
    with a fresh cache of verdicts."""
    monkeypatch.setattr(fewbit, "PROBED_DEVICES", {"cpu"})
    monkeypatch.setattr(fewbit, "EXACT_FORWARD", {})
    with kernels_on_cpu():
        yield


def _op_case(name, dtype, n=5000):
    x, borders, levels, bits, params = _case(name, 1, dtype, n)
    return x, borders, bits, params


@cpu_probe
def test_the_fused_forward_runs_where_the_probe_finds_it_exact(probed_on_cpu, monkeypatch):
    # relu's Triton formula is exact on every fp32 input; put it among the fused activations.
    monkeypatch.setattr(fewbit, "FUSED_ACTIVATIONS", fewbit.FUSED_ACTIVATIONS | {"relu"})
    x, borders, bits, params = _op_case("relu", torch.float32)
    launched = []
    real = fewbit.fewbit_forward_triton
    monkeypatch.setattr(
        fewbit, "fewbit_forward_triton", lambda *a: launched.append(a[5:]) or real(*a)
    )
    y, packed, flag = fewbit_forward(x, "relu", borders, bits, params)
    options = fewbit.EXACT_FORWARD["relu", (), torch.float32, x.device]
    assert options == fewbit.EXACT_OPTION_CANDIDATES[0]
    # The probe's launch, then the op's: one pass, output and codes together.
    assert launched == [(True, options), (True, options)]
    y_r, packed_r, flag_r = fewbit_forward_reference(x, "relu", borders, bits, params)
    assert torch.equal(y.view(torch.int32), y_r.view(torch.int32))
    assert torch.equal(packed, packed_r) and torch.equal(flag, flag_r)
    launched.clear()
    fewbit_forward(x, "relu", borders, bits, params)
    assert launched == [(True, options)]  # probed once per activation, dtype and device


@cpu_probe
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_where_the_probe_finds_a_difference_pytorch_computes_the_output(
    probed_on_cpu, dtype, caplog
):
    """Under the interpreter GELU's Triton math differs from PyTorch's CPU GELU in the last bit
    for some inputs: the op then returns PyTorch's output, exactly, and the kernel's codes."""
    x, borders, bits, params = _op_case("gelu", dtype)
    with caplog.at_level("INFO", logger="hf_actq"):
        y, packed, flag = fewbit_forward(x, "gelu", borders, bits, params)
    assert fewbit.EXACT_FORWARD["gelu", (), dtype, x.device] is None
    assert "differs from PyTorch's at x = [" in caplog.text
    expected = torch.nn.functional.gelu(x)
    integer = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(y.view(integer), expected.view(integer))
    _, packed_r, flag_r = fewbit_forward_reference(x, "gelu", borders, bits, params)
    assert torch.equal(packed, packed_r) and torch.equal(flag, flag_r)


def test_the_probe_covers_every_16_bit_value_and_fp32_at_each_exponent():
    for dtype in (torch.float16, torch.bfloat16):
        values = fewbit.probe_inputs(dtype, "cpu")
        assert values.view(torch.int16).unique().numel() == 65536
    values = fewbit.probe_inputs(torch.float32, "cpu")
    exponents = (values.view(torch.int32) >> 23) & 0xFF
    assert exponents.unique().numel() == 256
    assert values.isnan().any() and values.isinf().any()


@cpu_probe
def test_a_non_contiguous_input_takes_the_codes_kernel_and_pytorch(probed_on_cpu, monkeypatch):
    monkeypatch.setattr(fewbit, "FUSED_ACTIVATIONS", fewbit.FUSED_ACTIVATIONS | {"relu"})
    x, borders, bits, params = _op_case("relu", torch.float32, 4096)
    x = x.view(64, 64).t()
    y, packed, flag = fewbit_forward(x, "relu", borders, bits, params)
    assert fewbit.EXACT_FORWARD == {}  # not probed: the fused kernel reads x in memory order
    assert torch.equal(y, torch.relu(x)) and y.stride() == torch.relu(x).stride()
    _, packed_r, _ = fewbit_forward_reference(x, "relu", borders, bits, params)
    assert torch.equal(packed, packed_r)


@pytest.mark.skipif(not ON_GPU, reason="CUDA's math library runs on a GPU only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(fewbit.FUSED_ACTIVATIONS))
def test_on_a_gpu_the_fused_forward_equals_pytorch_on_every_probed_input(name, dtype):
    x, borders, bits, params = _op_case(name, dtype)
    assert fewbit.exact_forward_options(name, params, x, borders, bits) is not None
    y, packed, flag = fewbit_forward(x, name, borders, bits, params)
    integer = torch.int32 if dtype == torch.float32 else torch.int16
    expected = ACTIVATIONS[name].forward(x)  # PyTorch's CUDA kernel
    assert torch.equal(y.view(integer), expected.view(integer))
    _, packed_r, _ = fewbit_forward_reference(x.cpu(), name, borders.cpu(), bits, params)
    assert torch.equal(packed.cpu(), packed_r)
