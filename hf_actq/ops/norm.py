"""LayerNorm and RMSNorm that keep a compressed normalized input plus per-row fp32 statistics.

Backward needs ``x_hat = (x - mean) * rstd`` and ``rstd``: the ops keep ``x_hat`` compressed (it
has unit scale per row, which suits any codec) and ``rstd`` in fp32, one value per row. The
forward output is the unpatched module's, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from hf_actq.codecs import AverageQuantCodec
from hf_actq.codecs.packed import Codec
from hf_actq.ops.dedup import DEFAULT_CACHE


def _normalized_backward(grad_xhat, x_hat, rstd):
    """d/dx of x_hat = (x - mean) * rstd (LayerNorm) given dL/dx_hat, all fp32."""
    mean_g = grad_xhat.mean(-1, keepdim=True)
    mean_gx = (grad_xhat * x_hat).mean(-1, keepdim=True)
    return rstd * (grad_xhat - mean_g - x_hat * mean_gx)


class CompressedLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, codec, cache):
        width = x.shape[-1]
        y, mean, rstd = torch.native_layer_norm(x, (width,), weight, bias, eps)
        if rstd.dtype != torch.float32:
            # Some backends return half-precision statistics; backward wants fp32 ones.
            var, mean = torch.var_mean(x.float(), dim=-1, keepdim=True, correction=0)
            rstd = torch.rsqrt(var + eps)
        x_hat = ((x.float() - mean) * rstd).to(x.dtype)
        packed = cache.pack(x_hat, codec)
        ctx.header = packed.with_tensors(())
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        ctx.save_for_backward(rstd, weight, *packed.tensors)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        rstd, weight, *buffers = ctx.saved_tensors
        x_hat = ctx.header.with_tensors(buffers).unpack().float()
        g = grad_y.float()
        grad_xhat = g * weight.float() if ctx.has_weight else g
        grad_x = _normalized_backward(grad_xhat, x_hat, rstd).to(grad_y.dtype)
        rows = tuple(range(g.dim() - 1))
        grad_w = (g * x_hat).sum(rows).to(weight.dtype) if ctx.has_weight else None
        grad_b = g.sum(rows).to(grad_y.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


class CompressedRMSNormFunction(torch.autograd.Function):
    """HF's RMSNorm (LLaMA, Mistral, Qwen): ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``."""

    @staticmethod
    def forward(ctx, x, weight, eps, codec, cache):
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        normed = (hidden * rstd).to(x.dtype)
        y = weight * normed
        packed = cache.pack(normed, codec)
        ctx.header = packed.with_tensors(())
        ctx.save_for_backward(rstd, weight, *packed.tensors)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        rstd, weight, *buffers = ctx.saved_tensors
        x_hat = ctx.header.with_tensors(buffers).unpack().float()
        g = grad_y.float()
        grad_xhat = g * weight.float()
        mean_gx = (grad_xhat * x_hat).mean(-1, keepdim=True)
        grad_x = (rstd * (grad_xhat - x_hat * mean_gx)).to(grad_y.dtype)
        rows = tuple(range(g.dim() - 1))
        grad_w = (g * x_hat).sum(rows).to(weight.dtype)
        return grad_x, grad_w, None, None, None


class CompressedLayerNorm(nn.Module):
    """Wraps an ``nn.LayerNorm`` over the last dimension (sharing its parameters)."""

    def __init__(self, norm: nn.LayerNorm, codec: Codec | None = None, cache=None) -> None:
        super().__init__()
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise ValueError("CompressedLayerNorm wraps an nn.LayerNorm over the last dimension")
        self.norm = norm
        self.codec = codec if codec is not None else AverageQuantCodec(bits=4)
        self.cache = cache if cache is not None else DEFAULT_CACHE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm
        params = [p for p in (n.weight, n.bias) if p is not None]
        if not torch.is_grad_enabled() or not (
            x.requires_grad or any(p.requires_grad for p in params)
        ):
            return n(x)
        return CompressedLayerNormFunction.apply(x, n.weight, n.bias, n.eps, self.codec, self.cache)

    def extra_repr(self) -> str:
        return f"codec={self.codec!r}"


class CompressedRMSNorm(nn.Module):
    """Wraps a LLaMA-style RMSNorm module (``weight`` plus ``variance_epsilon`` or ``eps``):
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` as in Llama, Mistral and Qwen. Gemma's
    ``(1 + weight)`` form computed in fp32 is a different function and is not covered.
    """

    def __init__(self, norm: nn.Module, codec: Codec | None = None, cache=None) -> None:
        super().__init__()
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if getattr(norm, "weight", None) is None or eps is None:
            raise ValueError(
                f"CompressedRMSNorm needs a module with weight and variance_epsilon (or eps), "
                f"got {type(norm).__name__}"
            )
        self.norm = norm
        self.eps = float(eps)
        self.codec = codec if codec is not None else AverageQuantCodec(bits=4)
        self.cache = cache if cache is not None else DEFAULT_CACHE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.norm.weight
        if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
            return self.norm(x)
        return CompressedRMSNormFunction.apply(x, weight, self.eps, self.codec, self.cache)

    def extra_repr(self) -> str:
        return f"codec={self.codec!r}"


__all__ = [
    "CompressedLayerNorm",
    "CompressedLayerNormFunction",
    "CompressedRMSNorm",
    "CompressedRMSNormFunction",
]
