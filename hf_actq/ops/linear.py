"""Linear layer that keeps only a compressed copy of its input for backward.

``grad_input = grad_output @ W`` needs no input at all, so it stays exact; only
``grad_weight = grad_output^T @ x`` uses the dequantized input. With a frozen weight (LoRA base
layers, QLoRA) nothing is saved but the weight reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hf_actq.codecs import AverageQuantCodec
from hf_actq.codecs.packed import Codec
from hf_actq.ops.dedup import DEFAULT_CACHE, PackCache


class CompressedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, codec, cache):
        y = F.linear(x, weight, bias)
        ctx.has_bias = bias is not None
        ctx.weight_grad = weight.requires_grad
        if ctx.weight_grad:
            packed = cache.pack(x, codec)
            ctx.header = packed.with_tensors(())
            ctx.save_for_backward(weight, *packed.tensors)
        else:
            ctx.save_for_backward(weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        weight, *buffers = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(weight.to(grad_y.dtype))
        flat_grad = grad_y.reshape(-1, grad_y.shape[-1])
        if ctx.weight_grad and ctx.needs_input_grad[1]:
            x_hat = ctx.header.with_tensors(buffers).unpack()
            grad_w = flat_grad.t().matmul(x_hat.reshape(-1, x_hat.shape[-1]).to(grad_y.dtype))
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0)
        return grad_x, grad_w, grad_b, None, None


class CompressedLinear(nn.Module):
    """Wraps an ``nn.Linear`` (sharing its parameters) and compresses its saved input.

    Nothing is compressed under ``torch.no_grad()`` or when no gradient needs the input.
    """

    def __init__(
        self,
        linear: nn.Linear,
        codec: Codec | None = None,
        cache: PackCache | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"CompressedLinear wraps an nn.Linear, got {type(linear).__name__}")
        self.linear = linear
        self.codec = codec if codec is not None else AverageQuantCodec(bits=4)
        self.cache = cache if cache is not None else DEFAULT_CACHE

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    @property
    def bias(self):
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.linear.weight, self.linear.bias
        needs_grad = torch.is_grad_enabled() and (
            weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if not needs_grad:
            return self.linear(x)
        return CompressedLinearFunction.apply(x, weight, bias, self.codec, self.cache)

    def extra_repr(self) -> str:
        return f"codec={self.codec!r}"
