"""Packed activation checkpointing as an op: exact replay, gradients for every tensor input
(positional or keyword), parameters trained when no input needs a gradient, bytes kept, the
traced form torch.compile takes whole, and a router's choices replayed in the recompute."""

import functools
import weakref

import pytest
import torch
from torch import nn

from hf_actq import SavedTensorMeter
from hf_actq.codecs import uniform
from hf_actq.codecs.packed import ExactCodec
from hf_actq.memory.meter import graph_saved_bytes
from hf_actq.ops.packed_checkpoint import (
    REPLAY_KEY,
    Reparametrized,
    SelectionRecorder,
    SelectionReplay,
    draws_random_numbers,
    make_dropouts_replayable,
    packed_checkpoint,
    routes_tokens,
)
from hf_actq.testing import more_model, tiny_llama, tiny_model

WIDTH = 64


class Block(nn.Module):
    """A residual block with a norm, a GELU MLP, dropout and an optional additive bias given as
    a keyword (as T5 passes its position bias); returns a tuple with a None, as HF layers do."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x, scale=None, *, bias=None):
        h = self.down(nn.functional.gelu(self.up(self.norm(x))))
        if bias is not None:
            h = h + bias
        if scale is not None:
            h = h * scale
        return (x + self.dropout(h), None)


def _grads(block, x, bias, run):
    block.zero_grad()
    for t in (x, bias):
        t.grad = None
    torch.manual_seed(1)
    out, none = run(x, bias)
    assert none is None
    out.square().sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone(), bias.grad.clone()]


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(4, 16, WIDTH, requires_grad=True)
    bias = torch.randn(16, WIDTH, requires_grad=True)
    return x, bias


def _plain_and_packed(block, codec):
    """The block's gradients run plainly and under packed checkpointing, at the same seed."""
    x, bias = _inputs()
    plain = _grads(block, x, bias, lambda x, b: block(x, bias=b))
    packed = _grads(
        block,
        x,
        bias,
        lambda x, b: packed_checkpoint(functools.partial(block.forward, bias=b), x, codec=codec),
    )
    return plain, packed


def test_parameters_get_their_gradient_once_as_outputs_of_the_node():
    # DDP and DeepSpeed listen on each parameter's gradient accumulation: a parameter that two
    # checkpointed calls share (or that DDP took for unused because no node listed it) must see
    # one accumulation per backward, not one per recompute.
    block = Block().eval()
    accumulations = []
    block.up.weight.register_post_accumulate_grad_hook(lambda p: accumulations.append(1))
    x, _ = _inputs()
    run = functools.partial(packed_checkpoint, codec=ExactCodec(), layer=block)
    out = run(block.__call__, run(block.__call__, x)[0])[0]
    out.sum().backward()
    assert len(accumulations) == 1
    reference = Block().eval()
    reference.load_state_dict(block.state_dict())
    reference(reference(x.detach())[0])[0].sum().backward()
    torch.testing.assert_close(block.up.weight.grad, reference.up.weight.grad)


def test_exact_codec_replays_dropout_and_gives_every_input_its_gradient():
    """With an exact codec the checkpointed block gives bit-identical gradients to the plain
    one under dropout (the recompute draws the same masks), the keyword tensor included."""
    plain, packed = _plain_and_packed(Block().train(), ExactCodec())
    for a, b in zip(plain, packed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eight_bit_input_keeps_gradients_close_and_keeps_only_the_packed_input():
    block = Block().eval()  # no dropout: the gradients differ by the rounding alone
    plain, packed = _plain_and_packed(block, uniform(8))
    for a, b in zip(plain, packed, strict=True):
        cosine = nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cosine > 0.999
    x, bias = _inputs()
    params = list(block.parameters())
    with SavedTensorMeter(exclude=params) as stock:
        block(x, bias=bias)
    with SavedTensorMeter(exclude=params) as meter:
        packed_checkpoint(functools.partial(block.forward, bias=bias), x, codec=uniform(8))
    # The packed input (1 byte per value plus block metadata) and the bias, which is an input.
    expected = uniform(8).nbytes(x.shape) + bias.numel() * bias.element_size()
    assert meter.nbytes == expected
    assert meter.nbytes < stock.nbytes / 8


def test_the_full_precision_input_is_not_kept_alive():
    block = Block().eval()
    x = torch.randn(2, 8, WIDTH, requires_grad=True)
    hidden = x * 2  # a layer's input: alive only while something refers to it
    alive = weakref.ref(hidden)
    out, _ = packed_checkpoint(block.forward, hidden, codec=uniform(8))
    del hidden
    assert alive() is None
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_parameters_train_when_no_input_needs_a_gradient():
    """The first layer of a LoRA model gets hidden states that need no gradient; its trainable
    parameters must still get theirs (reentrant checkpointing would give them none)."""
    block = Block().eval()
    x = torch.randn(2, 8, WIDTH)
    out, _ = packed_checkpoint(block.forward, x, codec=uniform(8))
    assert out.requires_grad
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())


def test_positional_tensors_other_than_the_first_are_kept_and_get_gradients():
    block = Block().eval()
    x, _ = _inputs()
    scale = torch.rand(WIDTH, requires_grad=True)
    out, _ = packed_checkpoint(block.forward, x, scale, codec=uniform(8))
    out.sum().backward()
    reference = scale.grad.clone()
    scale.grad = None
    block(x, scale)[0].sum().backward()
    cosine = nn.functional.cosine_similarity(reference, scale.grad, dim=0)
    assert cosine > 0.999


def test_a_frozen_layer_with_inputs_that_need_no_gradient_is_not_checkpointed():
    block = Block().eval().requires_grad_(False)
    x = torch.randn(2, 8, WIDTH)
    params = list(block.parameters())
    with SavedTensorMeter(exclude=params) as meter:
        out, _ = packed_checkpoint(functools.partial(Block.forward, block), x, codec=uniform(8))
        bound, _ = packed_checkpoint(block.forward, x, codec=uniform(8))
    assert not out.requires_grad and not bound.requires_grad and meter.nbytes == 0


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_without_grad_it_just_runs_the_function(grad_mode):
    block = Block().eval()
    x = torch.randn(2, 8, WIDTH)
    context = torch.no_grad() if grad_mode == "no_grad" else torch.inference_mode()
    with context:
        out, _ = packed_checkpoint(block.forward, x, codec=uniform(4))
        torch.testing.assert_close(out, block(x)[0], rtol=0, atol=0)


def _traced_and_eager(block, x, bias, codec, train=True):
    """The block's gradients and saved bytes under packed checkpointing, eager and compiled."""
    wrapper = Reparametrized(block.train(train))

    def run(x, b):
        layer = functools.partial(Block.forward, block, bias=b)
        return packed_checkpoint(layer, x, codec=codec, reparametrized=wrapper)

    results = []
    torch._dynamo.reset()
    for runner in (run, torch.compile(run, backend="aot_eager", fullgraph=True)):
        torch.manual_seed(1)
        out, _ = runner(x, bias)
        saved = graph_saved_bytes(out, exclude=block.parameters())
        results.append((saved, _grads(block, x, bias, runner)))
    return results


def test_under_torch_compile_the_traced_form_has_no_break_and_the_eager_gradients():
    """fullgraph=True fails on any graph break. Same seed, same rounding: the traced form's
    gradients (by torch.func.vjp) equal the eager form's (by autograd), keyword tensor and
    parameters included, and the compiled graph keeps what eager keeps."""
    block = Block()
    block.dropout.p = 0.0
    x, bias = _inputs()
    (eager_saved, eager), (traced_saved, traced) = _traced_and_eager(block, x, bias, uniform(8))
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    expected = uniform(8).nbytes(x.shape) + bias.numel() * bias.element_size()
    assert eager_saved == expected and traced_saved <= expected


def test_a_block_with_dropout_keeps_the_eager_form_under_compile_and_replays_its_masks():
    """A traced recompute could not redraw the first pass's dropout masks: in training such a
    block runs the eager form (a graph break), whose exact-codec gradients equal the plain
    block's; in eval mode it draws nothing and takes the traced form."""
    block = Block()
    assert draws_random_numbers(block)
    x, bias = _inputs()
    wrapper = Reparametrized(block.train())
    codec = ExactCodec()

    def run(x, b):
        layer = functools.partial(Block.forward, block, bias=b)
        return packed_checkpoint(layer, x, codec=codec, reparametrized=wrapper)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(run)(x, bias)
    assert explained.graph_break_count > 0
    plain = _grads(block, x, bias, lambda x, b: block(x, bias=b))
    torch._dynamo.reset()
    compiled = _grads(block, x, bias, torch.compile(run, backend="aot_eager"))
    for a, b in zip(plain, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch._dynamo.reset()
    block.eval()
    codec = uniform(8)
    assert torch._dynamo.explain(run)(x, bias).graph_break_count == 0


def test_random_number_draws_are_recognised_by_dropout_modules_and_rates():
    class Attention(nn.Module):
        def __init__(self, rate):
            super().__init__()
            self.attention_dropout = rate  # as LLaMA's attention passes to SDPA

    block = Block()
    assert draws_random_numbers(block)
    block.dropout.p = 0.0
    assert not draws_random_numbers(block)
    block.attention = Attention(0.1)
    assert draws_random_numbers(block)
    block.attention.attention_dropout = 0.0
    assert not draws_random_numbers(block)


class LoraLike(nn.Module):
    """A layer whose only random draws are a PEFT-style ``lora_dropout``, applied to the
    keyword tensor so that the mask can be read off the output: ``out - proj(x)`` is
    ``scale * dropout(bias)``."""

    def __init__(self, p=0.3):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(p)})

    def forward(self, x, *, bias=None):
        return (self.proj(x) + self.scale * self.lora_dropout["default"](bias), None)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_lora_dropout_replays_its_mask_in_the_traced_form(backend):
    """fullgraph=True: a LoRA dropout no longer breaks the graph, and the recompute in backward
    uses the forward's mask: the gradients of ``scale`` and of the keyword tensor follow from
    the mask the output shows, exactly."""
    block = LoraLike().train()
    assert draws_random_numbers(block)
    undo = make_dropouts_replayable(block)
    wrapper = Reparametrized(block)
    assert not wrapper.draws_random_numbers and len(wrapper.replay_keys) == 1
    x, bias = _inputs()
    codec = uniform(8)

    def run(x, b):
        layer = functools.partial(LoraLike.forward, block, bias=b)
        return packed_checkpoint(layer, x, codec=codec, reparametrized=wrapper)[0]

    torch._dynamo.reset()
    out = torch.compile(run, backend=backend, fullgraph=True)(x, bias)
    dropped = ((out - block.proj(x)) / block.scale).detach()  # [batch, 16, WIDTH]
    torch.testing.assert_close(dropped, dropped[0].expand_as(dropped))  # a mask of bias's shape
    kept = dropped[0].abs() > 1e-4 * bias.abs()
    assert 0.6 < kept.float().mean() < 0.8  # p = 0.3
    torch.testing.assert_close(dropped[0][kept], (bias / 0.7)[kept])
    out.square().sum().backward()
    grad_out = 2 * out.detach()
    torch.testing.assert_close(block.scale.grad, (grad_out * dropped).sum())
    expected = grad_out.sum(0) * kept * block.scale.detach() / 0.7
    torch.testing.assert_close(bias.grad, expected, rtol=1e-5, atol=1e-5)

    undo()
    assert REPLAY_KEY not in block.lora_dropout["default"]._buffers
    assert "forward" not in vars(block.lora_dropout["default"])
    assert Reparametrized(block).draws_random_numbers


def test_replayable_dropout_is_stock_outside_the_traced_form():
    """Eager, in eval mode and with the key empty, the patched dropout is nn.Dropout: the
    same draws from torch's generator, and nothing in the state dict."""
    block = LoraLike().train()
    reference = LoraLike().train()
    reference.load_state_dict(block.state_dict())
    make_dropouts_replayable(block)
    assert make_dropouts_replayable(block)  # idempotent: a second call patches nothing more
    assert set(block.state_dict()) == set(reference.state_dict())
    x, bias = _inputs()
    for train in (True, False):
        block.train(train), reference.train(train)
        torch.manual_seed(3)
        got = block(x, bias=bias)[0]
        torch.manual_seed(3)
        torch.testing.assert_close(got, reference(x, bias=bias)[0], rtol=0, atol=0)


EXPERTS, TOP_K = 8, 2


class Routed(nn.Module):
    """A mixture of experts in one module: a softmax router picks TOP_K of EXPERTS square
    experts per token (``torch.topk``, as transformers' routers) and weighs their outputs;
    ``seen`` collects each pass's choices while ``record`` is set (eager only)."""

    def __init__(self):
        super().__init__()
        self.top_k = TOP_K
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / WIDTH**0.5)
        self.seen, self.record = [], False

    def forward(self, x):
        weights, chosen = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        if self.record:
            self.seen.append(chosen.clone())
        out = torch.einsum("...koi,...i->...ko", self.experts[chosen], x)
        return (x + (weights.unsqueeze(-1) * out).sum(-2),)


def _routed_run(block, codec, replays: bool):
    wrapper = Reparametrized(block)
    assert wrapper.routes_tokens
    wrapper.routes_tokens = replays  # off: the recompute routes the rounded input anew

    def run(x):
        return packed_checkpoint(block.forward, x, codec=codec, reparametrized=wrapper, layer=block)

    return run


def _routed_grads(block, x, run):
    block.zero_grad()
    x.grad = None
    torch.manual_seed(1)
    (out,) = run(x)
    out.square().sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


def test_a_routing_layer_is_recomputed_with_the_experts_its_first_pass_chose():
    """2 bits round the router's input enough to move most tokens' choices (without the replay
    the recompute routes them to other experts: the check below fails); with it every token
    goes to the experts its forward used. The choices are kept a byte each beside the pack."""
    torch.manual_seed(0)
    block, x = Routed(), torch.randn(4, 32, WIDTH, requires_grad=True)
    block.record = True
    codec = uniform(2)
    for replays in (False, True):
        block.seen.clear()
        run = _routed_run(block, codec, replays)
        (out,) = run(x)
        saved = graph_saved_bytes(out, exclude=block.parameters())
        out.square().sum().backward()
        first, recomputed = block.seen
        moved = int((first != recomputed).any(-1).sum())
        if replays:
            assert moved == 0
            assert saved == codec.nbytes(x.shape) + x.shape[0] * x.shape[1] * TOP_K
        else:
            assert moved > 0 and saved == codec.nbytes(x.shape)


def test_under_torch_compile_a_routing_layer_replays_its_choices_in_the_traced_form():
    """fullgraph=True: the modes trace without a break, and the compiled gradients equal the
    eager ones with the replay (and not those without it)."""
    torch.manual_seed(0)
    block, x = Routed(), torch.randn(4, 32, WIDTH, requires_grad=True)
    codec = uniform(2)
    results = {}
    for replays in (True, False):
        torch._dynamo.reset()
        run = _routed_run(block, codec, replays)
        compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
        results[replays] = (_routed_grads(block, x, run), _routed_grads(block, x, compiled))
    (eager, traced), (bare, _) = results[True], results[False]
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert not all(torch.allclose(a, b) for a, b in zip(eager, bare))


def test_the_replay_returns_the_recorded_choices_and_refuses_a_different_call():
    torch.manual_seed(0)
    scores = torch.randn(6, 300)
    with SelectionRecorder() as recorder:
        values, indices = scores.topk(3)
        best = torch.argmax(scores, dim=-1)
    narrow, index = recorder.choices
    assert narrow.dtype == torch.int16 and torch.equal(narrow.long(), indices)  # 300 choices
    assert torch.equal(index.long(), best)
    moved = scores + 10 * torch.randn(6, 300)
    replay = SelectionReplay(recorder.choices)
    with replay:
        again = torch.topk(moved, 3, dim=-1)
        argmax = moved.argmax(dim=-1)
    replay.check_done()
    assert torch.equal(again.indices, indices) and torch.equal(argmax, best)
    assert torch.equal(again.values, moved.gather(-1, indices))
    wider = r"chose \(6, 4\) in its topk #1, where its first"
    with pytest.raises(RuntimeError, match=wider), SelectionReplay(recorder.choices):
        moved.topk(4)
    with pytest.raises(RuntimeError, match="more often than its first pass"), SelectionReplay([]):
        moved.topk(3)
    replay = SelectionReplay(recorder.choices)
    with replay:
        moved.topk(3)
    with pytest.raises(RuntimeError, match="made 1 of the 2 choices"):
        replay.check_done()


def test_layers_with_a_router_or_experts_route_tokens_and_dense_ones_do_not():
    for name in ("mixtral", "qwen3_moe"):
        assert routes_tokens(more_model(name)[0].model.layers[0])
    assert routes_tokens(tiny_model("gpt_oss").model.layers[0])
    assert not routes_tokens(tiny_llama().model.layers[0]) and not routes_tokens(Block())
