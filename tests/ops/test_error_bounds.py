"""Documented gradient error per bit width (README, "Gradient error by bit width").

Relative L2 error of one backward against exact autograd, N(0, 1) inputs, fixed seed. Stochastic
rounding is unbiased, so these single-step errors average out over steps; the bounds are about
1.5x what was measured, so a regression that makes any op noisier fails here.
"""

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.ops.attention import compressed_eager_attention
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.linear import CompressedLinear
from hf_actq.ops.norm import CompressedLayerNorm, CompressedRMSNorm

CODECS = {
    "uniform 2": uniform(2),
    "uniform 4": uniform(4),
    "uniform 8": uniform(8),
    "AQ 0.5-bit": AverageQuantCodec(2, 4),
}
# Measured: linear grad_W, layernorm grad_x, rmsnorm grad_x, attention grad q/k/v (max).
BOUNDS = {
    "uniform 2": (1.05, 0.10, 0.10, 2.3),
    "uniform 4": (0.21, 0.019, 0.019, 0.40),
    "uniform 8": (0.013, 0.0011, 0.0011, 0.024),
    "AQ 0.5-bit": (1.4, 0.094, 0.094, 1.5),
}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def measure(codec):
    torch.manual_seed(1)
    linear = nn.Linear(256, 256)
    x = torch.randn(16, 64, 256, requires_grad=True)
    g = torch.randn(16, 64, 256)
    linear(x).backward(g)
    exact_w = linear.weight.grad.clone()
    linear.zero_grad()
    CompressedLinear(linear, codec, PackCache())(x).backward(g)
    errors = [_rel(linear.weight.grad, exact_w)]
    for norm, wrapper in (
        (nn.LayerNorm(256), CompressedLayerNorm),
        (LlamaRMSNorm(256), CompressedRMSNorm),
    ):
        x.grad = None
        norm(x).backward(g)
        exact_x = x.grad.clone()
        x.grad = None
        wrapper(norm, codec, PackCache())(x).backward(g)
        errors.append(_rel(x.grad, exact_x))
    module = nn.Module().eval()
    q, k, v = (torch.randn(4, 8, 64, 32, requires_grad=True) for _ in range(3))
    grad = torch.randn(4, 64, 8, 32)
    out, _ = compressed_eager_attention(module, q, k, v, None, codecs={}, cache=PackCache())
    out.backward(grad)
    exact = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    codecs = dict.fromkeys(("q", "k", "v", "probs"), codec)
    out, _ = compressed_eager_attention(module, q, k, v, None, codecs=codecs, cache=PackCache())
    out.backward(grad)
    errors.append(max(_rel(t.grad, e) for t, e in zip((q, k, v), exact)))
    return errors


@pytest.mark.parametrize("name", sorted(CODECS))
def test_gradient_error_within_documented_bound(name):
    for measured, bound in zip(measure(CODECS[name]), BOUNDS[name]):
        assert measured <= bound


def test_error_shrinks_with_bits():
    two, four, eight = (measure(uniform(b)) for b in (2, 4, 8))
    for a, b, c in zip(two, four, eight):
        assert a > b > c
