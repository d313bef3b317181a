"""Triton kernels under the interpreter (TRITON_INTERPRET=1, set in conftest) against their twins.

Packed codes, NaN flags and gradients must be bit-identical. Outputs of the fused forward may
differ in rounding because the kernel computes transcendentals with Triton math, not PyTorch's;
the bound checked (and documented in docs/reference.md) is |dy| <= 4 * eps(dtype) * max(1, |x|).
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
from hf_actq.kernels.fewbit import (  # noqa: E402  # noqa: E402
    ACTIVATION_IDS,
    fewbit_backward_reference,
    fewbit_backward_triton,
    fewbit_forward_reference,
    fewbit_forward_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
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
    for bits in (1, 3) if ACTIVATIONS[name].exact is None else (1,):
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
