"""Linear layer that keeps only a compressed copy of its input for backward.

``grad_input = grad_output @ W`` needs no input at all, so it stays exact; only
``grad_weight = grad_output^T @ x`` uses the dequantized input. With a frozen weight (LoRA base
layers, QLoRA) nothing is saved but the weight reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_actq.codecs.packed import Codec
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.state import (
    default_state,
    keep_rng_stream,
    once_differentiable,
    set_state,
    state_of,
    wants_backward,
)


class CompressedLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` keeping ``x`` packed into ``state``'s slot ``slot``."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, slot, weight_again=None):
        # weight_again: where given, makes ``weight`` again in backward (a PEFT fold, rebuilt
        # from the frozen base and the adapters), which is then not kept.
        y = F.linear(x, weight, bias)
        if y._base is not None:
            # With a bias, linear flattens a contiguous input, and its output is a view of the
            # 2-d product: returned from here, autograd would refuse in-place edits of it and
            # of its views, which the stock output allows. The 2-d product is returned instead
            # and viewed back outside (compressed_linear).
            y = y._base
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.weight_grad = weight.requires_grad
        ctx.weight_again = weight_again
        kept = weight if weight_again is None else weight.new_empty(0)
        if ctx.weight_grad:
            packed = state.pack(x, slot, linear_input=True)
            ctx.header = packed.with_tensors(())
            ctx.save_for_backward(kept, *packed.tensors)
        else:
            ctx.save_for_backward(kept)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        weight, *buffers = ctx.saved_tensors
        if ctx.weight_again is not None:
            weight = ctx.weight_again()
        grad_x = grad_w = grad_b = None
        # Casts and reshapes only where they change something: each is a dispatch (1-2 µs of
        # host time) even when it returns its input, and this runs for every linear layer.
        dtype = grad_y.dtype
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(weight if weight.dtype == dtype else weight.to(dtype))
            if grad_x.dim() != len(ctx.input_shape):
                grad_x = grad_x.reshape(ctx.input_shape)
        flat_grad = grad_y if grad_y.dim() == 2 else grad_y.reshape(-1, grad_y.shape[-1])
        if ctx.weight_grad and ctx.needs_input_grad[1]:
            x_hat = ctx.header.with_tensors(buffers).unpack()
            x_hat = x_hat if x_hat.dim() == 2 else x_hat.reshape(-1, x_hat.shape[-1])
            grad_w = flat_grad.t().matmul(x_hat if x_hat.dtype == dtype else x_hat.to(dtype))
            grad_w = grad_w if grad_w.dtype == weight.dtype else grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


SLOTS = ("input",)


def compressed_linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + module.bias``, keeping the packed input when backward needs it."""
    state = state_of(module)
    if not wants_backward(module, x, weight, module.bias):
        if weight.requires_grad:
            keep_rng_stream(module, state.codecs["input"])
        return state.plain(x)
    return linear_keeping_input(x, weight, module.bias, state, "input")


def linear_keeping_input(x, weight, bias, state, slot: str, weight_again=None) -> torch.Tensor:
    """:class:`CompressedLinearFunction` with its output in ``x``'s shape (a view made here,
    as the stock linear's output is one)."""
    y = CompressedLinearFunction.apply(x, weight, bias, state, slot, weight_again)
    return y if y.dim() == x.dim() else y.view(*x.shape[:-1], y.shape[-1])


class CompressedLinear(nn.Linear):
    """An ``nn.Linear`` sharing the parameters of ``linear`` that compresses its saved input.

    A drop-in replacement: same parameters, same state-dict keys, ``isinstance(m, nn.Linear)``.
    Nothing is compressed under ``torch.no_grad()`` or when no gradient needs the input.
    """

    def __init__(
        self, linear: nn.Linear, codec: Codec | None = None, cache: PackCache | None = None
    ) -> None:
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"CompressedLinear wraps an nn.Linear, got {type(linear).__name__}")
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        plain = nn.Linear.forward.__get__(self)
        set_state(self, default_state(plain, codec, cache, SLOTS))

    @property
    def codec(self) -> Codec:
        return state_of(self).codecs["input"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compressed_linear(self, x, self.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, codec={self.codec!r}"


class CompressedConv1D(nn.Module):
    """GPT-2's ``Conv1D`` (a linear layer with an [in, out] weight: ``x @ W + b``), sharing the
    parameters of ``conv`` and compressing its saved input like :class:`CompressedLinear`."""

    def __init__(self, conv: nn.Module, codec: Codec | None = None, cache=None) -> None:
        from transformers.pytorch_utils import Conv1D

        if not isinstance(conv, Conv1D):
            raise ValueError(f"CompressedConv1D wraps a Conv1D, got {type(conv).__name__}")
        super().__init__()
        self.nf, self.nx = conv.nf, conv.nx
        self.weight, self.bias = conv.weight, conv.bias
        set_state(self, default_state(Conv1D.forward.__get__(self), codec, cache, SLOTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compressed_linear(self, x, self.weight.t())
