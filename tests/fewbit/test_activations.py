import pytest
import torch
from torch import nn
from transformers.activations import ACT2CLS

from hf_actq.fewbit import ACTIVATIONS, get_activation

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(dtype):
    torch.manual_seed(0)
    x = torch.randn(4099) * 4
    x[:6] = torch.tensor([0.0, -0.0, 1e-7, -1e-30, 30.0, -30.0])
    return x.to(dtype)


# HF's ACT2CLS names and the module the few-bit forward must reproduce bit for bit.
HF_NAMES = [
    "gelu",
    "gelu_fast",
    "gelu_new",
    "gelu_python",
    "gelu_pytorch_tanh",
    "gelu_python_tanh",
    "gelu_accurate",
    "hardswish",
    "leaky_relu",
    "mish",
    "quick_gelu",
    "relu",
    "relu6",
    "sigmoid",
    "silu",
    "swish",
    "tanh",
]


def _hf_module(name):
    entry = ACT2CLS[name]
    cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
    return cls(**kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", HF_NAMES)
def test_forward_is_bit_identical_to_transformers(name, dtype):
    x = _inputs(dtype)
    spec = get_activation(name)
    expected = _hf_module(name)(x)
    assert torch.equal(spec.forward(x, **spec.params), expected)


TORCH_MODULES = {
    "selu": nn.SELU(),
    "softplus": nn.Softplus(),
    "elu": nn.ELU(),
    "celu": nn.CELU(),
    "hardtanh": nn.Hardtanh(),
    "hardsigmoid": nn.Hardsigmoid(),
    "relu6": nn.ReLU6(),
    "leaky_relu": nn.LeakyReLU(),
    "gelu_tanh": nn.GELU(approximate="tanh"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(TORCH_MODULES))
def test_forward_is_bit_identical_to_torch_nn(name, dtype):
    x = _inputs(dtype)
    spec = get_activation(name)
    assert torch.equal(spec.forward(x, **spec.params), TORCH_MODULES[name](x))


@pytest.mark.parametrize("name", [n for n, s in ACTIVATIONS.items() if s.derivative is not None])
def test_numpy_derivative_matches_autograd(name):
    spec = get_activation(name)
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64)
    x = x[(x.abs() > 1e-9) & ((x.abs() - 3).abs() > 1e-9)]  # skip kinks of selu/elu/hardswish
    x.requires_grad_(True)
    spec.forward(x, **spec.params).sum().backward()
    torch.testing.assert_close(
        torch.from_numpy(spec.derivative(x.detach().cpu().numpy(), **spec.params)).to(x.device),
        x.grad,
        rtol=1e-6,
        atol=1e-9,
    )


def test_unknown_name_and_parameters_raise():
    with pytest.raises(ValueError, match="unknown activation 'softmax'; allowed values:"):
        get_activation("softmax")
    with pytest.raises(ValueError, match="activation must be a string name"):
        get_activation(nn.GELU())


@pytest.mark.parametrize("name", sorted(ACT2CLS))
def test_activation_of_recognises_transformers_modules(name):
    from hf_actq.fewbit.activations import activation_of

    module = _hf_module(name)
    found = activation_of(module)
    unsupported = {"gelu_10", "laplace", "linear", "relu2", "sqrtsoftplus", "prelu", "xielu"}
    if name in unsupported:
        assert found is None
        return
    act, params = found
    x = _inputs(torch.float32)
    assert torch.equal(
        get_activation(act).forward(x, **{**get_activation(act).params, **params}), module(x)
    )


@pytest.mark.parametrize(
    "module",
    [nn.LeakyReLU(0.2), nn.ELU(0.5), nn.Softplus(2.0, 10.0), nn.Hardtanh(-2.0, 3.0), nn.CELU(1.5)],
    ids=repr,
)
def test_activation_of_reads_torch_parameters(module):
    from hf_actq.fewbit.activations import activation_of

    act, params = activation_of(module)
    x = _inputs(torch.float32)
    assert torch.equal(get_activation(act).forward(x, **params), module(x))
