"""The MoE router op: the router's own forward, its linear keeping the input packed."""

import types
from unittest import mock

import pytest
import torch

from hf_actq import SavedTensorMeter
from hf_actq.codecs import uniform
from hf_actq.codecs.packed import ExactCodec
from hf_actq.ops import moe_router
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.moe_router import SoftmaxKeepingLogits, compressed_router_forward, is_router
from hf_actq.ops.state import OpState, set_state
from hf_actq.testing import more_model, tiny_llama, tiny_model

TOKENS = 40


def _router(name: str):
    model = tiny_model(name) if name == "gpt_oss" else more_model(name)[0]
    mlp = model.model.layers[0].mlp
    router = mlp.router if name == "gpt_oss" else mlp.gate
    with torch.no_grad():  # a bias that is not zero: its gradient is checked too
        for p in router.parameters():
            p.normal_(0, 0.5)
    return router.train()


def _bind(router, codec):
    plain = types.MethodType(type(router).forward, router)
    set_state(router, OpState(plain=plain, codecs={"input": codec}, cache=PackCache()))
    router.forward = types.MethodType(compressed_router_forward, router)


def _step(router, x, grads):
    router.zero_grad()
    x = x.detach().clone().requires_grad_()
    with SavedTensorMeter(exclude=list(router.parameters())) as meter:
        logits, scores, indices = router(x)
    (logits * grads[0]).sum().add((scores * grads[1]).sum()).backward()
    named = {"input": x.grad, **{n: p.grad for n, p in router.named_parameters()}}
    return (logits, scores, indices), named, meter.nbytes


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_router_keeps_its_input_packed_and_its_outputs_and_choices_are_stock(name):
    """Outputs and choices bit for bit (the forward is the router's own); the input's gradient
    is exact (it needs the weight only) and the weight's (and gpt-oss's bias's) is taken at the
    rounded input: an exact codec gives stock's, 8 bits a cosine near 1. The router keeps the
    pack where it kept the input."""
    router = _router(name)
    hidden = router.weight.shape[1]
    x = torch.randn(TOKENS, hidden)
    generator = torch.Generator().manual_seed(3)
    grads = (torch.randn(TOKENS, router.num_experts, generator=generator),
             torch.randn(TOKENS, router.top_k, generator=generator))  # fmt: skip
    outs, stock, stock_bytes = _step(router, x, grads)
    for codec in (ExactCodec(), uniform(8)):
        _bind(router, codec)
        ours, got, nbytes = _step(router, x, grads)
        for a, b in zip(outs, ours, strict=True):
            assert torch.equal(a, b)
        torch.testing.assert_close(got["input"], stock["input"], rtol=1e-6, atol=1e-6)
        for param in ("weight", "bias"):
            if param not in stock:
                continue
            if isinstance(codec, ExactCodec):
                torch.testing.assert_close(got[param], stock[param], rtol=1e-6, atol=1e-6)
            else:
                cosine = torch.nn.functional.cosine_similarity(
                    got[param].flatten(), stock[param].flatten(), 0
                )
                assert cosine > 0.999, (param, cosine)
        if not isinstance(codec, ExactCodec):
            input_bytes = TOKENS * hidden * 4
            assert nbytes == stock_bytes - input_bytes + codec.nbytes(x.shape)


def test_a_frozen_router_keeps_nothing_of_its_input():
    router = _router("qwen3_moe").requires_grad_(False)
    x = torch.randn(TOKENS, router.weight.shape[1])
    _bind(router, uniform(4))
    with SavedTensorMeter() as meter:
        router(x.requires_grad_())
    stock = SavedTensorMeter()
    del router.forward
    with stock:
        router(x)
    assert meter.nbytes == stock.nbytes


def test_routers_are_found_by_structure_and_linear_layers_are_not():
    for name in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss"):
        assert is_router(_router(name)), name
    llama = tiny_llama()
    assert not any(is_router(m) for m in llama.modules())
    experts = more_model("qwen3_moe")[0].model.layers[0].mlp.experts
    assert not is_router(experts)  # num_experts, but no [num_experts, hidden] weight


@pytest.mark.parametrize(
    "dtype, softmax_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, None), (torch.bfloat16, None)],
)
def test_the_softmax_keeps_the_logits_and_gives_stock_values_and_gradients(dtype, softmax_dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, 16, generator=generator).mul(3).to(dtype)
    grad = torch.randn(TOKENS, 16, generator=generator)
    results = []
    for function in (
        lambda t: torch.nn.functional.softmax(t, dim=-1, dtype=softmax_dtype),
        lambda t: SoftmaxKeepingLogits.apply(t, -1, softmax_dtype),
    ):
        x = logits.clone().requires_grad_()
        with SavedTensorMeter() as meter:
            probs = function(x)
        probs.backward(grad.to(probs.dtype))
        results.append((probs, x.grad, meter.nbytes))
    (stock, stock_grad, stock_bytes), (ours, our_grad, our_bytes) = results
    assert torch.equal(ours, stock) and ours.dtype == stock.dtype
    assert torch.equal(our_grad, stock_grad)
    assert stock_bytes == stock.numel() * stock.element_size()
    assert our_bytes == logits.numel() * logits.element_size()


def test_a_half_precision_router_keeps_its_logits_instead_of_fp32_probabilities():
    """Qwen3-MoE's router in bf16: softmax in fp32 kept its output (4 bytes a logit); it keeps
    the bf16 logits (2), with the same outputs and gradients as with the stock softmax."""
    router = _router("qwen3_moe").to(torch.bfloat16)
    x = torch.randn(TOKENS, router.weight.shape[1], dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    grads = (torch.randn(TOKENS, router.num_experts, generator=generator).bfloat16(),
             torch.randn(TOKENS, router.top_k, generator=generator).bfloat16())  # fmt: skip
    _bind(router, ExactCodec())
    with mock.patch.object(moe_router, "SoftmaxKeepingLogits", _StockSoftmax):
        outs, stock, stock_bytes = _step(router, x, grads)
    ours, got, nbytes = _step(router, x, grads)
    for a, b in zip(outs, ours, strict=True):
        assert torch.equal(a, b)
    for name, value in stock.items():
        assert torch.equal(got[name], value), name
    assert stock_bytes - nbytes == TOKENS * router.num_experts * 2


class _StockSoftmax:
    @staticmethod
    def apply(logits, dim, dtype):
        return torch.nn.functional.softmax(logits, dim=dim, dtype=dtype)
