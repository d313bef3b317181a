"""Every standalone op under activation checkpointing, with dropout after it, and in the passes
that keep nothing for backward (no_grad, eval, inference mode)."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import CompressedDropout
from hf_actq.ops.gated_mlp import CompressedGatedMLP
from hf_actq.ops.linear import CompressedLinear
from hf_actq.ops.norm import CompressedLayerNorm, CompressedRMSNorm

WIDTH = 16
OPS = ["linear", "layernorm", "rmsnorm", "gated_mlp"]


def _op(name):
    torch.manual_seed(0)
    codec, cache = uniform(4), PackCache()
    if name == "linear":
        return CompressedLinear(nn.Linear(WIDTH, WIDTH), codec, cache)
    if name == "layernorm":
        return CompressedLayerNorm(nn.LayerNorm(WIDTH), codec, cache)
    if name == "rmsnorm":
        return CompressedRMSNorm(LlamaRMSNorm(WIDTH), codec, cache)
    mlp = LlamaMLP(LlamaConfig(hidden_size=WIDTH, intermediate_size=32, num_attention_heads=4))
    return CompressedGatedMLP(mlp, codec, cache=cache)


def _grads(layer, x, run):
    layer.zero_grad()
    x.grad = None
    torch.manual_seed(1)
    run(x).square().sum().backward()
    return [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("dropout", [nn.Dropout, CompressedDropout])
@pytest.mark.parametrize("op", OPS)
def test_checkpointed_gradients_equal_uncheckpointed_with_dropout_after(op, dropout, use_reentrant):
    # Reentrant checkpointing runs the first pass under no_grad and the recompute with grad; an
    # op that drew its rounding seeds in only one of them moved the RNG under the dropout, whose
    # recomputed mask then differed (gradient cosine 0.58-0.69 before the ops shared one rule).
    layer = nn.Sequential(_op(op), dropout(0.5), nn.Linear(WIDTH, WIDTH))
    x = torch.randn(
        8, WIDTH, generator=torch.Generator(torch.get_default_device()).manual_seed(2)
    ).requires_grad_()
    expected = _grads(layer, x, layer)
    got = _grads(layer, x, lambda t: checkpoint(layer, t, use_reentrant=use_reentrant))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", OPS)
def test_a_training_pass_without_grad_packs_nothing_but_keeps_the_rng_stream(op, monkeypatch):
    module = _op(op).train()
    x = torch.randn(8, WIDTH, requires_grad=True)
    torch.manual_seed(3)
    y = module(x)
    state_after_grad_pass = torch.get_rng_state()
    packs = []
    original = AverageQuantCodec.pack
    monkeypatch.setattr(AverageQuantCodec, "pack", lambda *a: packs.append(1) or original(*a))
    torch.manual_seed(3)
    with torch.no_grad():
        y_no_grad = module(x)
    assert packs == []
    assert torch.equal(torch.get_rng_state(), state_after_grad_pass)
    assert torch.equal(y_no_grad, y.detach())


@pytest.mark.parametrize("op", OPS)
def test_eval_and_inference_mode_draw_nothing(op):
    module = _op(op)
    x = torch.randn(8, WIDTH)
    for mode in (torch.no_grad, torch.inference_mode):
        module.eval()
        torch.manual_seed(4)
        with mode():
            module(x)
        assert torch.equal(torch.get_rng_state(), torch.manual_seed(4).get_state())
        module.train()
        with mode():  # train mode: seeds drawn for the RNG stream, nothing packed or cached
            module(x)
