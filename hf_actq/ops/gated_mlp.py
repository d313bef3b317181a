"""Gated MLP (LLaMA, Mistral, Qwen, GeGLU): ``down(act(gate(x)) * up(x))`` without keeping any
full-precision intermediate-size tensor.

Unpatched autograd keeps x (for gate and up), gate (for act), act(gate) and up (for the product)
and the product (for down): four intermediate-size tensors. Here:

- gate and up are :class:`CompressedLinear` layers sharing one packed copy of x;
- the fused product-and-down op keeps the few-bit code of act'(gate) (``activation_bits`` bits),
  compressed act(gate) and compressed up, and rebuilds down's input as their product in
  backward instead of storing a third copy.

The forward output equals the unpatched module's bit for bit (same ops in the same order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hf_actq.codecs import AverageQuantCodec
from hf_actq.codecs.packed import Codec
from hf_actq.fewbit.activations import activation_of, get_activation, resolve_params
from hf_actq.fewbit.tables import table_for
from hf_actq.kernels import fewbit_backward, fewbit_forward
from hf_actq.ops.dedup import DEFAULT_CACHE, PackCache
from hf_actq.ops.linear import CompressedLinear


class GatedDownFunction(torch.autograd.Function):
    """``F.linear(act(gate) * up, weight, bias)`` keeping codes and compressed operands; with
    ``weight=None`` just the product ``act(gate) * up`` (for a down projection that must run as
    its own module, e.g. wrapped by PEFT LoRA)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act, borders, levels, bits, codec, cache):
        name, params = act
        activated, codes, nan_flag = fewbit_forward(gate, name, borders, bits, params)
        y = activated * up
        if weight is not None:
            y = F.linear(y, weight, bias)
        packed_a = cache.pack(activated, codec)
        packed_up = cache.pack(up, codec)
        ctx.headers = (packed_a.with_tensors(()), packed_up.with_tensors(()))
        ctx.split = len(packed_a.tensors)
        ctx.bits, ctx.has_bias = bits, bias is not None
        ctx.save_for_backward(
            weight, codes, levels, nan_flag, *packed_a.tensors, *packed_up.tensors
        )
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        weight, codes, levels, nan_flag, *buffers = ctx.saved_tensors
        header_a, header_up = ctx.headers
        a_hat = header_a.with_tensors(buffers[: ctx.split]).unpack()
        up_hat = header_up.with_tensors(buffers[ctx.split :]).unpack()
        dtype = grad_y.dtype
        grad_h = grad_y if weight is None else grad_y.matmul(weight.to(dtype))
        flat_grad = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = grad_b = None
        if ctx.needs_input_grad[2]:
            h_hat = (a_hat * up_hat).reshape(-1, a_hat.shape[-1]).to(dtype)
            grad_w = flat_grad.t().matmul(h_hat).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = flat_grad.sum(0)
        grad_up = grad_h * a_hat.to(dtype)
        grad_gate = fewbit_backward(grad_h * up_hat.to(dtype), codes, levels, nan_flag, ctx.bits)
        return grad_gate, grad_up, grad_w, grad_b, None, None, None, None, None, None


class CompressedGatedMLP(nn.Module):
    """Wraps an HF gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``), sharing its
    parameters."""

    def __init__(
        self,
        mlp: nn.Module,
        codec: Codec | None = None,
        activation_bits: int = 3,
        cache: PackCache | None = None,
    ) -> None:
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, name):
                raise ValueError(
                    f"CompressedGatedMLP needs gate_proj, up_proj, down_proj and act_fn; "
                    f"{type(mlp).__name__} has no {name}"
                )
        found = activation_of(mlp.act_fn)
        if found is None:
            raise ValueError(
                f"CompressedGatedMLP: unsupported activation {type(mlp.act_fn).__name__}"
            )
        self.mlp = mlp
        self.codec = codec if codec is not None else AverageQuantCodec(bits=4)
        self.cache = cache if cache is not None else DEFAULT_CACHE
        # Kept unregistered: the projections are already submodules of ``mlp`` (registering
        # them twice would duplicate state-dict keys).
        self._projections = (
            CompressedLinear(mlp.gate_proj, self.codec, self.cache),
            CompressedLinear(mlp.up_proj, self.codec, self.cache),
        )
        spec = get_activation(found[0])
        self.activation = (spec.name, resolve_params(spec, found[1]))
        self.table = table_for(spec.name, activation_bits, **self.activation[1])
        self.register_buffer(
            "borders", torch.tensor(self.table.borders, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "levels", torch.tensor(self.table.levels, dtype=torch.float32), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.mlp.down_proj
        if not torch.is_grad_enabled():
            return self.mlp(x)
        gate_proj, up_proj = self._projections
        gate, up = gate_proj(x), up_proj(x)
        if not (gate.requires_grad or up.requires_grad or down.weight.requires_grad):
            return self.mlp(x)
        name, params = self.activation
        return GatedDownFunction.apply(
            gate,
            up,
            down.weight,
            down.bias,
            (name, tuple(params.values())),
            self.borders.to(x.device),
            self.levels.to(x.device),
            self.table.bits,
            self.codec,
            self.cache,
        )

    def extra_repr(self) -> str:
        return f"codec={self.codec!r}, activation={self.activation[0]!r}, bits={self.table.bits}"
