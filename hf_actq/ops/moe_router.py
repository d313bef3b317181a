"""A mixture of experts' router keeping its input packed, as a linear layer does.

transformers 5's routers (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``, ``GptOssTopKRouter``,
...) are modules of their own that call ``F.linear(hidden_states, self.weight[, self.bias])`` on
the MoE block's input, then a softmax and a top-k of the model's own. Where the router's weight
trains (full fine-tuning, or PEFT's LoRA on it, which "all-linear" adds on Qwen3-MoE), that
linear keeps the input exact: at Qwen3-30B-A3B shapes 8 MiB of a layer's ~35 under "uniform"
4 bits, and the experts, whose weights train too, keep the same tensor. Here the router's forward
runs as it is, with its ``F.linear`` calls taken by :class:`CompressedLinearFunction` into the
``input`` slot (a linear layer's input, so the experts op, which packs the same tensor into its
own ``input`` slot, shares the pack). The top-k stays the model's, exact; the softmax over the
logits (Qwen2/3-MoE's, OLMoE's: in fp32, ``dtype=torch.float``) keeps the logits instead of its
fp32 output and computes it again in backward, bit for bit: at Qwen3-30B-A3B's shapes (128
experts, bf16) 0.5 MiB a layer instead of 1 MiB."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hf_actq.ops.linear import linear_keeping_input
from hf_actq.ops.state import keep_rng_stream, once_differentiable, state_of, wants_backward


class SoftmaxKeepingLogits(torch.autograd.Function):
    """``F.softmax(logits, dim, dtype=dtype)`` keeping ``logits`` (a half-precision router's
    are half the bytes of its fp32 probabilities) and computing the probabilities again in
    backward, where stock softmax keeps them: the same values, the same gradient."""

    @staticmethod
    def forward(ctx, logits, dim, dtype):
        probs = F.softmax(logits, dim=dim, dtype=dtype)
        ctx.dim, ctx.dtype = dim, probs.dtype
        ctx.save_for_backward(logits)
        return probs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        probs = F.softmax(logits, dim=ctx.dim, dtype=ctx.dtype)
        # Stock: softmax's backward in the probabilities' dtype, then the cast's, to the logits'.
        grad = torch._softmax_backward_data(grad, probs, ctx.dim, probs.dtype)
        return grad.to(logits.dtype), None, None


class _LinearKeepingInput(TorchFunctionMode):
    """Inside a router's forward: each ``F.linear`` onto its ``experts`` logits keeps its input
    packed into ``state``'s ``input`` slot, and a softmax over those logits keeps them
    (:class:`SoftmaxKeepingLogits`); every other call (a LoRA fold's own products, a softmax
    over a cast of the logits) runs as it is."""

    def __init__(self, state, experts: int, weight_again=None):
        super().__init__()
        self.state, self.experts, self.weight_again = state, experts, weight_again
        self.logits = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            if weight.dim() == 2 and weight.shape[0] == self.experts:
                bias = rest[0] if rest else kwargs.get("bias")
                self.logits = linear_keeping_input(
                    x, weight, bias, self.state, "input", self.weight_again
                )
                return self.logits
        elif func is F.softmax and args and args[0] is self.logits:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            dtype = kwargs.get("dtype", args[3] if len(args) > 3 else None)
            if isinstance(dim, int) and self.logits.requires_grad:
                return SoftmaxKeepingLogits.apply(self.logits, dim, dtype)
        return func(*args, **kwargs)


def compressed_router_forward(self, *args, **kwargs):
    """The router's own forward, its linear keeping the input packed, whenever autograd
    records; otherwise the forward as it was."""
    state = state_of(self)
    trains = _weight_trains(self)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not wants_backward(self, *tensors, *self.parameters()) and not (
        trains and self.training and torch.is_grad_enabled()
    ):
        if trains:  # the seed its pack would draw (checkpointing replays the stream)
            keep_rng_stream(self, state.codecs["input"])
        return state.plain(*args, **kwargs)
    with _LinearKeepingInput(state, self.num_experts, _weight_again(self, state)):
        return state.plain(*args, **kwargs)


def _weight_again(module: torch.nn.Module, state):
    """How to make the router's weight again in backward where it is PEFT's LoRA fold of the
    parameter (the adapters' deltas added to the base: ``_LoraParameterProxy``), with PEFT's
    own ``get_delta_weight``: the linear then does not keep the fold's output, a copy of the
    weight made each forward (0.5 MiB a layer at Qwen3-30B-A3B in bf16). None otherwise:
    a parameter, another fold, a sharded base (ZeRO-3, FSDP2: whole only while gathered) or a
    trace (which traces the fold itself)."""
    from torch.nn.utils import parametrize

    wrapper = state.lora_wrappers.get("weight")
    if (
        wrapper is None
        or torch.compiler.is_compiling()
        or not parametrize.is_parametrized(module, "weight")
    ):
        return None
    chain = module.parametrizations["weight"]
    folds, original = list(chain), getattr(chain, "original", None)
    if (
        len(folds) != 1
        or type(folds[0]).__name__ != "_LoraParameterProxy"
        or original is None
        or hasattr(original, "ds_id")
        or type(original).__name__ == "DTensor"
    ):
        return None
    adapters = tuple(a for a in wrapper.active_adapters if a in wrapper.lora_A)
    if not adapters:
        return None
    return functools.partial(_folded_again, type(folds[0]), original, wrapper, adapters)


def _folded_again(proxy, original, wrapper, adapters) -> torch.Tensor:
    """PEFT's fold (``ParamWrapper._activate_lora``), step for step, without a graph."""
    with torch.no_grad():
        delta = None
        for adapter in adapters:
            part = wrapper.get_delta_weight(adapter)
            delta = part if delta is None else delta + part
        return proxy(delta)(original)


def _weight_trains(module: torch.nn.Module) -> bool:
    """Whether the router's weight takes a gradient: a trained parameter, or PEFT's LoRA fold
    over it (a parametrization, whose factors live on PEFT's wrapper)."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, "weight"):
        return True
    weight = module._parameters.get("weight")
    return weight is not None and weight.requires_grad


def is_router(module: torch.nn.Module) -> bool:
    """A transformers MoE router module: not a linear layer itself, with an integer ``top_k``
    and ``num_experts`` and a 2-D ``weight`` of ``num_experts`` rows (PEFT's LoRA on it makes
    ``weight`` a parametrization, which reads the same)."""
    if isinstance(module, torch.nn.Linear):
        return False
    top_k, experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (top_k, experts)):
        return False
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, "weight"):
        weight = module.parametrizations["weight"].original
    else:
        weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and weight.shape[0] == experts
