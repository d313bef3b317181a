"""Attention's gated output (Qwen3.5, Qwen3-Next): ``output * sigmoid(gate)`` kept as the
output's and the gate's packs, its product offered to o_proj (hf_actq/ops/gated_output.py)."""

import copy

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.codecs.packed import ExactCodec
from hf_actq.memory.meter import graph_saved_bytes
from hf_actq.ops import gated_output
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.gated_output import SLOTS, GateWindow
from hf_actq.ops.state import STATE, default_state
from hf_actq.testing import HYBRID_EXACT, hybrid_model, metered_step


def _gated(model):
    return [m for m in model.modules() if getattr(m.__dict__.get(STATE), "gated_output", False)]


def _count_products(monkeypatch) -> list:
    calls = []
    apply = gated_output.GatedProductFunction.apply
    monkeypatch.setattr(
        gated_output.GatedProductFunction,
        "apply",
        lambda *args: calls.append(1) or apply(*args),
    )
    return calls


@pytest.mark.parametrize(
    "name, implementation",
    [
        ("qwen3_5_text", "sdpa"),
        ("qwen3_next", "sdpa"),
        ("qwen3_5_moe_text", "sdpa"),
        # The model's own eager function, run again in backward (the window opens there too).
        ("qwen3_5_text", "eager"),
    ],
)
def test_an_exact_gated_product_gives_the_stock_forward_and_gradients_bit_for_bit(
    name, implementation, monkeypatch
):
    model, batch = hybrid_model(name)
    model.config._attn_implementation = implementation
    forward, grads, _ = metered_step(model, batch)
    patched = copy.deepcopy(model)
    handle = hf_actq.apply(patched, ActQConfig(**HYBRID_EXACT))
    gated = _gated(patched)
    assert gated and all("sigmoid(gate)" in handle.patched[s.path] for s in map(_state, gated))
    kind = "sdpa" if implementation == "sdpa" else "eager, recomputed"
    assert all(f"attention ({kind})" in handle.patched[_state(m).path] for m in gated)
    calls = _count_products(monkeypatch)
    got_forward, got_grads, _ = metered_step(patched, batch)
    assert len(calls) == len(gated)  # each gated layer's product ran through the op
    assert torch.equal(got_forward, forward)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, grads))
    assert torch._C._len_torch_function_stack() == 0  # every window closed


def _state(module):
    return module.__dict__[STATE]


def _attention_bytes(model, batch, paths):
    """Bytes kept by the attention modules at ``paths`` and by their o_proj, each summed, and
    the whole step's (by the hooks and by the graph walk)."""
    params = list(model.parameters())
    with SavedTensorMeter(exclude=params, model=model) as meter:
        loss = model(**batch).loss
    walked = graph_saved_bytes([loss], exclude=params)
    loss.backward()
    model.zero_grad()
    own = sum(n for path, n in meter.by_module().items() if path in paths)
    projection = sum(
        n for path, n in meter.by_module().items() if path in {p + ".o_proj" for p in paths}
    )
    return own, projection, meter.nbytes, walked


def test_uniform_keeps_the_output_and_the_gate_packed_and_o_proj_takes_their_product():
    """Stock autograd keeps the output and the sigmoid (two tensors of the output's size), and
    o_proj packs the product; here attention keeps the two packs in their place and o_proj
    none of its own. The hooks and the graph walk count the same bytes."""
    model, batch = hybrid_model("qwen3_5_text")
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, ActQConfig.from_recipe("uniform"))
    plain = copy.deepcopy(patched)
    for module in _gated(plain):
        _state(module).gated_output = False
    (attention,) = _gated(patched)
    codec = _state(attention).codecs["output"]
    shape = (*batch["input_ids"].shape, attention.o_proj.in_features)
    pack = codec.pack(torch.randn(shape)).nbytes
    paths = {_state(attention).path}
    own, projection, nbytes, walked = _attention_bytes(patched, batch, paths)
    plain_own, plain_projection, *_ = _attention_bytes(plain, batch, paths)
    assert (projection, plain_projection) == (0, pack)
    assert plain_own - own == 2 * torch.Size(shape).numel() * 4 - 2 * pack  # fp32 tensors
    assert nbytes == walked


def test_only_the_first_gated_product_runs_as_the_op_and_other_uses_keep_their_gradients():
    torch.manual_seed(0)
    x, other, gate = (torch.randn(3, 8, requires_grad=True) for _ in range(3))
    state = default_state(None, ExactCodec(), PackCache(), SLOTS)

    def run(window):
        if window is not None:
            window.enter()
        try:
            sigmoid = torch.sigmoid(gate)
            y = x * sigmoid
            z = other * sigmoid  # the sigmoid again: stock, through its own node
            return y, z, (y * 2 + z + sigmoid).sum()
        finally:
            if window is not None:
                window.leave()

    y, z, loss = run(GateWindow(state))
    grads = torch.autograd.grad(loss, (x, other, gate))
    want_y, want_z, want_loss = run(None)
    want = torch.autograd.grad(want_loss, (x, other, gate))
    assert type(y.grad_fn).__name__ == "GatedProductFunctionBackward"
    assert type(z.grad_fn).__name__ == "MulBackward0"
    assert torch.equal(y, want_y) and torch.equal(z, want_z)
    assert torch.equal(grads[0], want[0]) and torch.equal(grads[1], want[1])
    # The gate's gradient sums two sigmoid backwards where stock sums before its one: rounding.
    torch.testing.assert_close(grads[2], want[2], rtol=1e-6, atol=1e-7)
    assert torch._C._len_torch_function_stack() == 0


def test_a_forward_that_raises_closes_its_window():
    model, batch = hybrid_model("qwen3_5_text")
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    (attention,) = _gated(model)

    def fail(module, args):
        raise RuntimeError("from a hook")

    hook = attention.o_proj.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="from a hook"):
        model(**batch)
    assert torch._C._len_torch_function_stack() == 0
    assert _state(attention).gate_window is None
    hook.remove()
    model(**batch).loss.backward()  # and the next step runs


def test_without_grad_and_under_compile_the_product_is_stock(monkeypatch):
    model, batch = hybrid_model("qwen3_5_text")
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    calls = _count_products(monkeypatch)
    with torch.no_grad():
        model(**batch)
    assert not calls
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    (attention,) = _gated(model)
    state = _state(attention)
    assert gated_output.run_gated(state, lambda: state.gate_window) is None


def test_the_window_sees_few_torch_calls(monkeypatch):
    """A host budget: each torch call in the window (the rest of the attention forward after
    attention returned: the product, o_proj and its pack) passes through the mode's handler in
    Python. 25 in a tiny Qwen3.5's one gated layer under "uniform" (torch 2.13)."""
    model, batch = hybrid_model("qwen3_5_text")
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    calls = []
    handler = GateWindow.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(GateWindow, "__torch_function__", counted)
    model(**batch).loss.backward()
    assert len(_gated(model)) == 1 and 0 < len(calls) <= 30
