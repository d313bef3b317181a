"""Attention's gated output, ``output * sigmoid(gate)``, kept as two packs.

Qwen3.5 and Qwen3-Next gate each attention layer's output by the sigmoid of a second half of
``q_proj``'s output before ``o_proj``. Stock autograd keeps for that product the attention output
and the sigmoid (two tensors of the output's size in the model's dtype), and ``o_proj`` packs the
product a third time. Here the product keeps the output and the gate's logits packed by the
attention module's "output" and "gate" slots, its backward takes the sigmoid again from the
unpacked logits, and it offers ``o_proj`` the product rebuilt from those packs (where the recipe
shares outputs), so that ``o_proj`` packs nothing of its own. The forward's value is the stock
one; with exact codecs the gradients are the stock ones bit for bit.

The product is stock code in the attention module's forward, with no module or function to bind.
While that forward runs on after the compressed attention function returned (the module's
forward is wrapped: :func:`run_gated`), a ``TorchFunctionMode`` (:class:`GateWindow`) watches its
torch calls: it remembers what ``sigmoid`` returned and sends the first product of such a
sigmoid with a tensor of its shape and dtype through :class:`GatedProductFunction`. Everything
else passes through as it came, including any other use of the sigmoid's output, which keeps its
stock graph (the gate's gradient then sums both paths, as stock).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from hf_actq.ops.dedup import may_offer
from hf_actq.ops.gated_mlp import ProductPacked
from hf_actq.ops.state import OpState, once_differentiable, state_of

# The slots of a gated attention output: attention's output and the gate's logits.
SLOTS = ("output", "gate")


class GatedProductFunction(torch.autograd.Function):
    """``x * sigmoid(gate)``, given the stock ``sigmoid`` of ``gate`` (detached: the value is
    the stock product's), keeping ``gate`` packed and, where the gate takes a gradient, ``x``."""

    @staticmethod
    def forward(ctx, x, gate, sigmoid, state: OpState):
        y = x * sigmoid
        packs = (state.pack(gate, "gate"),)
        if ctx.needs_input_grad[1]:  # the gate's gradient reads x
            packs += (state.pack(x, "output"),)
        ctx.headers = tuple(p.with_tensors(()) for p in packs)
        ctx.split = len(packs[0].tensors)
        ctx.save_for_backward(*(t for p in packs for t in p.tensors))
        if len(packs) == 2 and packs[0].codec == packs[1].codec and may_offer(state):
            # o_proj (and its LoRA adapter) take the product rebuilt from these two packs.
            rebuilt = GatedPacked(
                codec=packs[0].codec,
                shape=y.shape,
                dtype=y.dtype,
                tensors=(*packs[1].tensors, *packs[0].tensors),
                operands=(ctx.headers[1], ctx.headers[0]),
                split=len(packs[1].tensors),
            )
            state.cache.offer(y, rebuilt, state.slot_id("product"))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        buffers = ctx.saved_tensors
        gate = ctx.headers[0].with_tensors(buffers[: ctx.split]).unpack()
        sigmoid = torch.sigmoid(gate)
        grad_x = grad_y * sigmoid if ctx.needs_input_grad[0] else None
        grad_gate = None
        if ctx.needs_input_grad[1]:
            x = ctx.headers[1].with_tensors(buffers[ctx.split :]).unpack()
            # Stock: the product's gradient for the sigmoid, then the sigmoid's backward.
            grad_gate = torch.ops.aten.sigmoid_backward(grad_y * x, sigmoid)
        return grad_x, grad_gate, None, None


class _Sigmoid(torch.autograd.Function):
    """``torch.sigmoid(gate)`` whose node holds the gate (its input, alive upstream) rather than
    saving its output: the product takes the sigmoid's value, and the node goes with the output
    where nothing else uses it. Stock's node saves the output, which saved-tensor hooks (the
    memory meter's) hold in a cycle with the node, so that it stayed counted."""

    @staticmethod
    def forward(ctx, gate):
        ctx.gate = gate
        return torch.sigmoid(gate)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(ctx.gate))


@dataclass(frozen=True)
class GatedPacked(ProductPacked):
    """The gated product ``x * sigmoid(gate)`` rebuilt from the packs its op keeps anyway,
    offered to the output projection, whose input it is: a gated MLP's rebuilt product with a
    sigmoid of its second operand. ``tensors``: x's buffers, then the gate's."""

    def _unpack(self) -> torch.Tensor:
        x, gate = self.operands
        x = x.with_tensors(self.tensors[: self.split]).unpack()
        return x * torch.sigmoid(gate.with_tensors(self.tensors[self.split :]).unpack())


_SIGMOIDS = (torch.sigmoid, torch.Tensor.sigmoid)
_PRODUCTS = (torch.mul, torch.Tensor.mul)


class GateWindow(TorchFunctionMode):
    """The torch calls of an attention module's forward after its attention function returned:
    the first ``x * sigmoid(gate)`` (either order) of same-shaped, same-dtype tensors runs as
    :class:`GatedProductFunction`; every call before and after it as it came."""

    def __init__(self, state: OpState) -> None:
        super().__init__()
        self.state = state
        self.open = False
        self.done = False
        # id of each sigmoid's output -> (a weak reference to it, its input)
        self.sigmoids: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.done or kwargs:
            return func(*args, **(kwargs or {}))
        if func in _SIGMOIDS and len(args) == 1 and type(args[0]) is torch.Tensor:
            gate = args[0]
            grad = gate.requires_grad and torch.is_grad_enabled()
            output = _Sigmoid.apply(gate) if grad else func(gate)
            self.sigmoids[id(output)] = (weakref.ref(output), args[0])
            return output
        if func in _PRODUCTS and len(args) == 2:
            y = self._gated(*args)
            y = self._gated(args[1], args[0]) if y is None else y
            if y is not None:
                self.done = True
                self.sigmoids.clear()
                return y
        return func(*args)

    def _gated(self, x, sigmoid):
        found = self.sigmoids.get(id(sigmoid))
        if found is None or found[0]() is not sigmoid:
            return None
        gate = found[1]
        if not (
            type(x) is torch.Tensor
            and type(gate) is torch.Tensor
            and x.shape == sigmoid.shape == gate.shape
            and x.dtype == sigmoid.dtype == gate.dtype
            and x.is_floating_point()
            and (x.requires_grad or gate.requires_grad)
            and torch.is_grad_enabled()
        ):
            return None
        return GatedProductFunction.apply(x, gate, sigmoid.detach(), self.state)

    def enter(self) -> None:
        if not self.open and not self.done:
            self.open = True
            self.__enter__()

    def leave(self) -> None:
        if self.open:
            self.open = False
            self.__exit__(None, None, None)


def open_gate_window(state: OpState) -> None:
    """Called by the compressed attention functions with their module's state as they return
    with an output that takes a gradient: from here on, the module's forward runs in its window
    (where it has one)."""
    if state.gate_window is not None:
        state.gate_window.enter()


def run_gated(state: OpState, forward, *args, **kwargs):
    """``forward(*args, **kwargs)``, an attention module's forward, with a window for its
    attention function to open, closed as the forward returns or raises. No window where its
    output is not gated, without grad, or in a torch.compile trace (the stock product there)."""
    if not state.gated_output or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return forward(*args, **kwargs)
    window = state.gate_window = GateWindow(state)
    try:
        return forward(*args, **kwargs)
    finally:
        state.gate_window = None
        window.leave()


def gated_attention_forward(self, *args, **kwargs):
    """The attention module's own forward, its gated product kept as two packs."""
    state = state_of(self)
    return run_gated(state, state.plain, *args, **kwargs)
