import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_actq import SavedTensorMeter
from hf_actq.fewbit import ACTIVATIONS, optimal_table
from hf_actq.ops import FewBitActivation, FewBitELU, FewBitGELU, FewBitReLU

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bf16_truncated(v: np.ndarray) -> np.ndarray:
    return (v.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _codes(module, x):
    """Independent oracle for the codes (see hf_actq.fewbit.activations for the semantics), as a
    CPU tensor."""
    table = module.table
    v = x.detach().float().cpu().numpy()
    mode = module.spec.code_mode
    if mode == "interval":
        lo, hi = np.float32(table.borders)
        return torch.from_numpy(((v > lo) & (v < hi)).astype(np.int64))
    if mode == "threshold":
        return torch.from_numpy((v > np.float32(table.borders[0])).astype(np.int64))
    v = _bf16_truncated(v)
    if mode == "symmetric":
        v = np.abs(v)
    return torch.from_numpy(np.searchsorted(np.float32(table.borders), v, side="left"))


def _levels(module, x):
    """The derivative level of each element of ``x``, on ``x``'s device."""
    return module.levels[_codes(module, x)].to(x.device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_3bit_keeps_only_the_packed_codes(dtype):
    n = 64 * 1001
    x = torch.randn(64, 1001, dtype=dtype, requires_grad=True)
    with SavedTensorMeter() as baseline:
        nn.GELU()(x)
    with SavedTensorMeter() as fewbit:
        FewBitGELU(bits=3)(x)
    assert baseline.nbytes == n * x.element_size()
    assert fewbit.nbytes <= math.ceil(3 * n / 8) + 1024
    assert fewbit.nbytes >= math.ceil(3 * n / 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_forward_exact_and_backward_is_grad_times_level(name, dtype):
    module = FewBitActivation(name, bits=3)
    torch.manual_seed(0)
    x = (torch.randn(33, 65) * 3).to(dtype).requires_grad_()
    y = module(x)
    assert y.dtype == dtype and torch.equal(y, module.spec.forward(x.detach(), **module.params))
    grad = torch.randn_like(y)
    y.backward(grad)
    levels = _levels(module, x)
    assert torch.equal(x.grad, (grad.float() * levels).to(dtype))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradient_close_to_exact_gelu_at_3_bits(approximate):
    torch.manual_seed(0)
    x = torch.randn(1_000_000)
    exact_x = x.clone().requires_grad_()
    F.gelu(exact_x, approximate=approximate).backward(torch.ones_like(x))
    fewbit_x = x.clone().requires_grad_()
    FewBitGELU(bits=3, approximate=approximate)(fewbit_x).backward(torch.ones_like(x))
    cosine = F.cosine_similarity(fewbit_x.grad, exact_x.grad, dim=0).item()
    assert cosine >= 0.99
    # With a random upstream gradient too (what training sees).
    grad = torch.randn_like(x)
    exact_x.grad = fewbit_x.grad = None
    F.gelu(exact_x, approximate=approximate).backward(grad)
    FewBitGELU(bits=3, approximate=approximate)(fewbit_x).backward(grad)
    assert F.cosine_similarity(fewbit_x.grad, exact_x.grad, dim=0).item() >= 0.99


def test_more_bits_give_closer_gradients():
    torch.manual_seed(0)
    x = torch.randn(200_000)
    exact = torch.func.grad(lambda t: F.silu(t).sum())(x)
    errors = []
    for bits in (1, 2, 3, 4):
        xr = x.clone().requires_grad_()
        FewBitActivation("silu", bits)(xr).sum().backward()
        errors.append((xr.grad - exact).pow(2).mean().item())
    assert errors == sorted(errors, reverse=True)


def test_custom_table_with_normal_weight():
    table = optimal_table("gelu", 2, weight="normal")
    module = FewBitGELU(bits=2, table=table)
    assert module.table is table
    x = torch.randn(1000, requires_grad=True)
    module(x).sum().backward()
    assert torch.equal(x.grad, _levels(module, x))


def test_non_contiguous_any_shape_and_empty():
    module = FewBitActivation("gelu_new", 2)
    base = torch.randn(6, 10, 12)
    x = base.transpose(0, 2)[:, ::2].requires_grad_()
    assert not x.is_contiguous()
    y = module(x)
    assert y.shape == x.shape and torch.equal(y, module.spec.forward(x.detach()))
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, _levels(module, x))
    for shape in [(0,), (3, 0, 2), ()]:
        e = torch.randn(shape, requires_grad=True)
        out = module(e)
        out.sum().backward()
        assert out.shape == shape and e.grad.shape == shape


def test_nan_input_gives_nan_gradient_and_inf_does_not_crash():
    module = FewBitGELU(bits=3)
    x = torch.tensor([0.5, float("inf"), -float("inf"), -1.0], requires_grad=True)
    module(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    x = torch.tensor([0.5, float("nan"), -1.0], requires_grad=True)
    module(x).sum().backward()
    assert torch.isnan(x.grad[1])


def test_no_grad_and_frozen_inputs_keep_nothing():
    module = FewBitGELU(bits=3)
    x = torch.randn(1000)
    with SavedTensorMeter() as meter:
        y = module(x)
        with torch.no_grad():
            module(x.requires_grad_())
    assert meter.nbytes == 0 and torch.equal(y, F.gelu(x))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 64), FewBitGELU(bits=2), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    layer(x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    checkpoint(layer, x, use_reentrant=use_reentrant).square().sum().backward()
    got = [p.grad for p in layer.parameters()] + [x.grad]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_saved_tensor_hooks_see_the_packed_buffer():
    seen = []

    def pack(t):
        seen.append((t.dtype, t.numel()))
        return t

    x = torch.randn(1000, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = FewBitGELU(bits=3)(x)
    assert (torch.uint8, 375) in seen
    y.sum().backward()
    expected = x.grad.clone()
    x.grad = None
    # save_on_cpu copies every saved tensor into (pinned) CPU memory and back: the codes survive
    # the round trip and give the same gradient.
    offloaded = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: offloaded.append(t.dtype) or t.clone(), lambda t: t
    ):
        FewBitGELU(bits=3)(x).sum().backward()
    assert torch.equal(x.grad, expected) and torch.uint8 in offloaded
    x.grad = None
    with torch.autograd.graph.save_on_cpu():
        FewBitGELU(bits=3)(x).sum().backward()
    assert torch.equal(x.grad, expected)


def test_state_dict_is_unchanged_and_half_keeps_fp32_tables():
    model = nn.Sequential(nn.Linear(4, 4), FewBitGELU(bits=3))
    assert set(model.state_dict()) == {"0.weight", "0.bias"}
    model = model.to(torch.bfloat16)
    assert model[1].levels.dtype == torch.float32 and model[1].borders.dtype == torch.float32
    assert model[1].borders.tolist() == pytest.approx(list(model[1].table.borders), abs=1e-6)


def test_repr_shows_bits_and_kind():
    assert "bits=3 (error=0.0119)" in repr(FewBitGELU(bits=3))
    assert "bits=1 (exact)" in repr(FewBitReLU(bits=3))
    assert "alpha=0.5" in repr(FewBitELU(bits=2, alpha=0.5))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FewBitGELU(bits=5), "bits must be an integer in 1..4, got 5"),
        (lambda: FewBitGELU(bits="3"), "bits must be an integer in 1..4, got '3'"),
        (lambda: FewBitActivation("softmax"), "unknown activation 'softmax'; allowed values"),
        (lambda: FewBitGELU(approximate="erf"), 'approximate must be "none" or "tanh"'),
        (lambda: FewBitELU(beta=1.0), "unknown parameter"),
        (lambda: FewBitActivation("tanh", 2, table=optimal_table("gelu", 2)), "symmetric"),
    ],
)
def test_invalid_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_integer_input_raises():
    with pytest.raises(ValueError, match="needs a floating-point input"):
        FewBitGELU()(torch.arange(4))


@pytest.mark.slow
def test_more_than_2_31_elements_index_correctly():
    n = 2**31 + 13
    x = torch.empty(n, dtype=torch.float16)
    x[: 2**20].normal_()
    x[2**20 :].fill_(-1.0)
    x[-64:] = torch.linspace(-4, 4, 64, dtype=torch.float16)
    x.requires_grad_()
    module = FewBitGELU(bits=3)
    y = module(x)
    y.backward(torch.ones(1, dtype=torch.float16).expand(n))
    tail = x[-64:].detach()
    assert torch.equal(x.grad[-64:], _levels(module, tail).half())
    assert torch.equal(y[-64:], F.gelu(tail))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    name=st.sampled_from(["gelu", "silu", "tanh", "hardsigmoid", "leaky_relu"]),
    bits=st.integers(1, 4),
    transpose=st.booleans(),
)
def test_property_any_shape_stride_dtype(shape, dtype, name, bits, transpose):
    module = FewBitActivation(name, bits)
    x = (torch.randn(shape) * 3).to(dtype)
    if transpose and x.dim() > 1:
        x = x.transpose(0, -1)
    x.requires_grad_()
    y = module(x)
    assert torch.equal(y, module.spec.forward(x.detach(), **module.params))
    grad = torch.randn(y.shape).to(dtype)
    y.backward(grad)
    assert torch.equal(x.grad, (grad.float() * _levels(module, x)).to(dtype))
