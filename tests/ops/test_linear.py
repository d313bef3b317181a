import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_actq import SavedTensorMeter
from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.linear import CompressedLinear


def _exact_grads(linear, x, grad):
    x = x.detach().clone().requires_grad_()
    linear.zero_grad()
    linear(x).backward(grad)
    return x.grad, linear.weight.grad.clone(), linear.bias.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("codec", [uniform(4), AverageQuantCodec(2, 4), uniform(8)], ids=repr)
def test_keeps_only_the_packed_input(codec, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    x = torch.randn(4, 16, 64, dtype=dtype, requires_grad=True)
    with SavedTensorMeter(exclude=list(linear.parameters())) as meter:
        CompressedLinear(linear, codec, PackCache())(x)
    assert meter.nbytes == codec.nbytes(x.shape) < x.numel() * x.element_size()


def test_input_gradient_is_exact_and_weight_gradient_uses_the_dequantized_input():
    torch.manual_seed(0)
    linear = nn.Linear(32, 24)
    codec = uniform(3, stochastic=False)
    x = torch.randn(5, 7, 32, requires_grad=True)
    grad = torch.randn(5, 7, 24)
    exact_x, exact_w, exact_b = _exact_grads(linear, x, grad)
    linear.zero_grad()
    CompressedLinear(linear, codec, PackCache())(x).backward(grad)
    got_x, got_w, got_b = x.grad, linear.weight.grad, linear.bias.grad
    torch.testing.assert_close(got_x, exact_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_b, exact_b)
    x_hat = codec.pack(x.detach()).unpack()
    expected_w = grad.reshape(-1, 24).t() @ x_hat.reshape(-1, 32)
    torch.testing.assert_close(got_w, expected_w, rtol=1e-5, atol=1e-5)
    cosine = torch.nn.functional.cosine_similarity(got_w.flatten(), exact_w.flatten(), dim=0)
    assert cosine > 0.95  # 3-bit round-to-nearest on 32-wide rows


def test_stochastic_weight_gradient_is_unbiased():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    x = torch.randn(64, 16)
    grad = torch.randn(64, 8)
    _, exact_w, _ = _exact_grads(linear, x, grad)
    total = torch.zeros_like(exact_w)
    trials = 400
    module = CompressedLinear(linear, uniform(2), PackCache())
    for _ in range(trials):
        linear.zero_grad()
        module(x.clone().requires_grad_()).backward(grad)  # a new activation each step
        total += linear.weight.grad
    single_error = (linear.weight.grad - exact_w).abs().mean()
    mean_error = (total / trials - exact_w).abs().mean()
    assert mean_error < single_error / 8


def test_frozen_weight_saves_nothing():
    linear = nn.Linear(32, 32)
    linear.weight.requires_grad_(False)
    linear.bias.requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    with SavedTensorMeter(exclude=list(linear.parameters())) as meter:
        y = CompressedLinear(linear, uniform(4), PackCache())(x)
    assert meter.nbytes == 0
    y.sum().backward()
    assert x.grad is not None


def test_shared_input_is_packed_once():
    torch.manual_seed(0)
    cache = PackCache()
    q, k, v = (CompressedLinear(nn.Linear(64, 64), uniform(4), cache) for _ in range(3))
    x = torch.randn(8, 64, requires_grad=True)
    params = [p for m in (q, k, v) for p in m.parameters()]
    with SavedTensorMeter(exclude=params) as meter:
        out = q(x) + k(x) + v(x)
    assert meter.nbytes == uniform(4).nbytes(x.shape)
    out.sum().backward()
    # A new tensor (or an in-place change of this one) is packed again.
    with torch.no_grad():
        x.mul_(2)
    with SavedTensorMeter(exclude=params) as meter:
        q(x) + k(x)
    assert meter.nbytes == uniform(4).nbytes(x.shape)
    del x, out
    assert len(cache) == 0


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_replays_the_same_codes(use_reentrant):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    layer[0] = CompressedLinear(layer[0], uniform(2), PackCache())
    layer[2] = CompressedLinear(layer[2], uniform(2), PackCache())
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(1)
    layer(x).square().sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.manual_seed(1)
    checkpoint(layer, x, use_reentrant=use_reentrant).square().sum().backward()
    for got, want in zip([p.grad for p in layer.parameters()], expected):
        assert torch.equal(got, want)


def test_no_grad_keeps_nothing_and_matches_linear():
    linear = nn.Linear(8, 8)
    x = torch.randn(3, 8)
    with SavedTensorMeter() as meter, torch.no_grad():
        y = CompressedLinear(linear, uniform(4))(x)
    assert meter.nbytes == 0 and torch.equal(y, linear(x))


def test_wraps_only_linear():
    with pytest.raises(ValueError, match="wraps an nn.Linear, got Conv1d"):
        CompressedLinear(nn.Conv1d(2, 2, 1))


@pytest.mark.parametrize("bias", [True, False])
def test_views_of_a_compressed_linears_output_can_be_edited_in_place_as_stock(bias):
    """DeBERTa's ``q = proj(x).view(...).permute(...); q /= scale``: the stock output allows it
    (autograd refused it when the op's output was a view made inside the op)."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 12, bias=bias)
    x = torch.randn(2, 5, 8, requires_grad=True)

    def run(module):
        q = module(x).view(2, 5, 3, 4).permute(0, 2, 1, 3)
        q /= 2.0
        q.pow(2).sum().backward()
        grads = [t.grad.clone() for t in (x, *linear.parameters())]
        for t in (x, *linear.parameters()):
            t.grad = None
        return q.detach(), grads

    stock, stock_grads = run(linear)
    ours, grads = run(
        CompressedLinear(linear, codec=uniform(8, stochastic=False), cache=PackCache())
    )
    assert torch.equal(ours, stock)
    torch.testing.assert_close(grads[0], stock_grads[0])  # the input's: exact
