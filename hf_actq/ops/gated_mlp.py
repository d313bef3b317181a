"""Gated MLP (LLaMA, Mistral, Qwen, GeGLU): ``down(act(gate(x)) * up(x))`` without keeping any
full-precision intermediate-size tensor.

Unpatched autograd keeps x (for gate and up), gate (for act), act(gate) and up (for the product)
and the product (for down): four intermediate-size tensors. Here:

- gate and up keep one packed copy of x between them (a frozen weight keeps nothing);
- the fused product-and-down op keeps the few-bit code of act'(gate) (``activation_bits`` bits),
  compressed act(gate) and compressed up, and rebuilds down's input as their product in
  backward instead of storing a third copy.

The forward output equals the unpatched module's bit for bit (same ops in the same order). With
uniform/AQ operands on a GPU the product is one kernel each way (``kernels/gated_product.py``):
forward, act(gate), its codes, the product and both packs from one read of gate and up (where
the few-bit forward's probe found act exact); backward, the gradients of gate and up (and down's
input where down's weight is trained) from one read of the gradient, the packs and the codes.
Both give the bits of the op-by-op path, with the same seeds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_actq.codecs.average import AverageQuantCodec
from hf_actq.codecs.packed import Codec, Packed, UnpackShare
from hf_actq.fewbit.activations import activation_of
from hf_actq.kernels import fewbit_backward, gated_backward, gated_forward
from hf_actq.kernels.gated_product import row_stride
from hf_actq.kernels.registry import runs_kernels
from hf_actq.ops.dedup import PackCache, may_offer
from hf_actq.ops.fewbit_activation import ActivationTable
from hf_actq.ops.linear import linear_keeping_input
from hf_actq.ops.slots import observer
from hf_actq.ops.state import (
    OpState,
    default_state,
    has_hooks,
    keep_rng_stream,
    kernel_reads,
    once_differentiable,
    packs_in_kernel,
    set_state,
    state_of,
    wants_backward,
)

logger = logging.getLogger("hf_actq")


class GatedDownFunction(torch.autograd.Function):
    """``F.linear(act(gate) * up, weight, bias)`` keeping codes and compressed operands; with
    ``weight=None`` just the product ``act(gate) * up`` (for a down projection that must run as
    its own module, e.g. wrapped by PEFT LoRA)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, state):
        act = state.activation
        levels = act.tensors(gate.device)[1]
        fused = product_forward(state, gate, up)
        if fused is None:
            activated, codes, nan_flag = act.forward_and_codes(gate)
            y = activated * up
            packed_a = state.pack(activated, "gate")
            packed_up = state.pack(up, "up")
        else:
            y, codes, nan_flag, packed_a, packed_up = fused
        if weight is not None:
            y = F.linear(y, weight, bias)
            y = y if y._base is None else y._base  # a 2-d product, viewed back outside (linear.py)
        ctx.gate_shape = gate.shape
        ctx.headers = (packed_a.with_tensors(()), packed_up.with_tensors(()))
        ctx.split = len(packed_a.tensors)
        ctx.bits, ctx.has_bias = act.bits, bias is not None
        ctx.save_for_backward(
            weight, codes, levels, nan_flag, *packed_a.tensors, *packed_up.tensors
        )
        if weight is None and packed_a.codec == packed_up.codec and may_offer(state):
            # The down projection runs as its own module (PEFT LoRA's): its lora_A may take the
            # product rebuilt from the operands kept here instead of packing it again.
            rebuilt = ProductPacked(
                codec=packed_a.codec,
                shape=y.shape,
                dtype=y.dtype,
                tensors=(*packed_a.tensors, *packed_up.tensors),
                operands=ctx.headers,
                split=ctx.split,
            )
            state.cache.offer(y, rebuilt, state.slot_id("product"))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        weight, codes, levels, nan_flag, *buffers = ctx.saved_tensors
        packed_a = ctx.headers[0].with_tensors(buffers[: ctx.split])
        packed_up = ctx.headers[1].with_tensors(buffers[ctx.split :])
        dtype = grad_y.dtype
        grad_h = grad_y if weight is None else grad_y.matmul(weight.to(dtype))
        grad_h = grad_h.reshape(ctx.gate_shape)
        with_product = ctx.needs_input_grad[2]  # the weight's gradient needs down's input
        grad_gate, grad_up, h_hat = product_backward(
            grad_h, packed_a, packed_up, codes, levels, nan_flag, ctx.bits, with_product
        )
        flat_grad = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = grad_b = None
        if with_product:
            grad_w = flat_grad.t().matmul(h_hat.reshape(-1, h_hat.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = flat_grad.sum(0)
        return grad_gate, grad_up, grad_w, grad_b, None


def product_backward(grad_h, packed_a, packed_up, codes, levels, nan_flag, bits, with_product):
    """``(grad_gate, grad_up, product)`` of ``act(gate) * up`` from ``grad_h``, the packed
    act(gate) and up and act's few-bit codes (``product``: rebuilt from the packs where
    ``with_product``, else None): one ``hf_actq::gated_backward`` where it takes the packs, else
    the composition (two unpacks, three products, the few-bit backward)."""
    dtype = grad_h.dtype
    if not _one_kernel_takes(packed_a, packed_up, grad_h):
        a_hat, up_hat = packed_a.unpack(), packed_up.unpack()
        product = (a_hat * up_hat).to(dtype) if with_product else None
        grad_up = grad_h * a_hat.to(dtype)
        grad_gate = fewbit_backward(grad_h * up_hat.to(dtype), codes, levels, nan_flag, bits)
        return grad_gate, grad_up, product
    for packed in (packed_a, packed_up):
        share = packed._share  # (a trace unpacks each pack alone: no shares there)
        if share is not None and share.consumers > 1 and not torch.compiler.is_compiling():
            share.leave()  # another op's unpack of it is not waited for here
    grad_gate, grad_up, product = gated_backward(
        grad_h,
        *packed_a.tensors,
        *packed_up.tensors,
        codes,
        levels,
        nan_flag,
        _aq_layout(packed_a.codec),
        _aq_layout(packed_up.codec),
        bits,
        with_product,
    )
    return grad_gate, grad_up, product if with_product else None


def product_forward(state: OpState, gate: torch.Tensor, up: torch.Tensor):
    """``(product, codes, nan_flag, packed act(gate), packed up)`` from one kernel
    (``hf_actq::gated_forward``), with the seeds, cache entries and shares ``state.pack`` would
    give the two packs; None where the op-by-op path must run: a slot not uniform/AQ, operands
    not alike (contiguous, or evenly spaced rows as the halves of one projection's output), an
    ``up`` the cache may hold, an observer watching the
    packs (measurement and calibration see every tensor packed), a trace, or no kernel to run
    (CPU: the twin would be that very path)."""
    codecs = (state.codecs["gate"], state.codecs["up"])
    if (
        not packs_in_kernel(gate, codecs)
        or gate.shape != up.shape
        or gate.dtype != up.dtype
        or gate.stride() != up.stride()
        or row_stride(gate) is None
        or up.is_inference()
        or state.cache.holds(up)
    ):
        return None
    act = state.activation
    slots = (state.slot_id("gate"), state.slot_id("up"))
    seeds = [state.cache.seed_for(codec, slot) or 0 for codec, slot in zip(codecs, slots)]
    layouts = [[c.bits, c.group_size, c.block_size, int(c.stochastic)] for c in codecs]
    borders = act.tensors(gate.device)[0]
    out = gated_forward(
        gate, up, act.spec.name, borders, act.bits, act.param_values, *layouts, seeds
    )
    product, codes, nan_flag = out[:3]
    packed_a = Packed(codecs[0], gate.shape, gate.dtype, tuple(out[3:6]))
    packed_up = Packed(codecs[1], up.shape, up.dtype, tuple(out[6:9]))
    object.__setattr__(packed_a, "_share", UnpackShare(consumers=1))
    state.cache.remember(up, packed_up, slots[1])
    return product, codes, nan_flag, packed_a, packed_up


def _one_kernel_takes(packed_a: Packed, packed_up: Packed, grad_h: torch.Tensor) -> bool:
    """Whether ``hf_actq::gated_backward`` can take the backward from these packs: uniform/AQ
    packs of tensors in the gradient's dtype whose groups divide the last dim. A pack that other
    ops keep too (PEFT's down_proj lora_A takes the product rebuilt from them) is unpacked once
    for all (``UnpackShare``): its tensor is taken instead where the twin would run, which would
    unpack it again."""
    for packed in (packed_a, packed_up):
        share = packed._share
        if not kernel_reads(packed, grad_h) or (
            share is not None and share.consumers > 1 and not runs_kernels(grad_h)
        ):
            return False
    return True


def _aq_layout(codec: AverageQuantCodec) -> list[int]:
    return [codec.bits, codec.group_size, codec.block_size]


@dataclass(frozen=True)
class ProductPacked(Packed):
    """A gated MLP's product ``act(gate) * up`` rebuilt from the packed operands its op keeps
    anyway, offered to a down projection that runs as its own module (PEFT LoRA's ``lora_A``,
    whose input it is), which then packs nothing of its own: the same product of the unpacked
    operands that the fused path's down projection takes for its weight gradient. ``tensors``:
    act(gate)'s buffers, then up's."""

    operands: tuple[Packed, ...] = ()  # act(gate)'s and up's packs, without their tensors
    split: int = 0

    @property
    def sources(self) -> tuple[Packed, ...]:
        return self.operands

    def _unpack(self) -> torch.Tensor:
        gate, up = self.operands
        activated = gate.with_tensors(self.tensors[: self.split]).unpack()
        return activated * up.with_tensors(self.tensors[self.split :]).unpack()


# The slots of a gated MLP: x (shared by gate and up), the few-bit code of act'(gate) (kept by
# the state's activation table), and the product's operands act(gate) and up (kept by codecs).
SLOTS = ("input", "act", "gate", "up")
CODEC_SLOTS = ("input", "gate", "up")


def gated_down(state: OpState, gate, up, down: nn.Module | None) -> torch.Tensor:
    """``down(act(gate) * up)`` through :class:`GatedDownFunction` with the state's activation,
    codecs and cache; with ``down=None`` only the product."""
    watcher = observer()
    if watcher is not None:
        watcher.on_fewbit(state.slot_id("act"), gate, state.activation)
    weight, bias = (None, None) if down is None else (down.weight, down.bias)
    y = GatedDownFunction.apply(gate, up, weight, bias, state)
    return y if y.dim() == gate.dim() else y.view(*gate.shape[:-1], y.shape[-1])


def runs_as_linear(module) -> bool:
    """Whether a fused op may compute ``module``'s linear itself instead of calling it: a plain
    ``nn.Linear`` with no accelerate hook (which may move or load its weights), no
    instance-level forward of someone else's, and no torch hooks (a user's, or
    ``torch.nn.utils.prune``'s, which recomputes the weight before each call)."""
    return (
        type(module) is nn.Linear
        and not hasattr(module, "_hf_hook")
        and "forward" not in module.__dict__
        and not has_hooks(module)
    )


def plain_projections(mlp: nn.Module) -> bool:
    return all(runs_as_linear(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))


def _warn_replaced(module: nn.Module, state: OpState) -> None:
    if not state.warned_replaced:
        state.warned_replaced = True
        logger.warning(
            "hf_actq: a projection of %s was replaced or given hooks after hf_actq.apply; it "
            "runs as its own module now (hooks included) with its input kept stock, and only "
            "the gated product stays compressed (apply after get_peft_model or the hooks to "
            "compress it too)",
            state.path or type(module).__name__,
        )


def follows_activation(state: OpState, current: nn.Module) -> bool:
    """Whether the fused product may run with ``current``, the activation module the MLP holds
    now: the one the state's derivative table was made for, an equal one, or a replacement
    hf_actq supports (it gets a table of its own at the same bits). For one it cannot fuse, the
    caller runs the stock forward (warned once)."""
    if current is state.act_module:
        return True
    found = activation_of(current)
    table = state.activation
    if found is not None:
        if found != (table.spec.name, table.params):
            state.activation = ActivationTable(found[0], table.bits, found[1])
        state.act_module = current
        return True
    if not state.warned_activation:
        state.warned_activation = True
        logger.warning(
            "hf_actq: the activation of %s was replaced after hf_actq.apply by %s, which "
            "hf_actq cannot fuse; the MLP runs stock",
            state.path or "a gated MLP",
            type(current).__name__,
        )
    return False


class CompressedGatedMLP(nn.Module):
    """An HF gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``) sharing the
    submodules of ``mlp`` (same state-dict keys).

    With plain ``nn.Linear`` projections, gate and up share one packed x and the product op keeps
    the few-bit code and compressed operands. With wrapped projections (PEFT LoRA, quantized
    layers) they run as their own modules and only the product ``act(gate) * up`` is compressed
    here.
    """

    def __init__(
        self,
        mlp: nn.Module,
        codec: Codec | None = None,
        activation_bits: int = 3,
        cache: PackCache | None = None,
    ) -> None:
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
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn
        activation = ActivationTable(found[0], activation_bits, found[1])
        state = default_state(mlp.forward, codec, cache, CODEC_SLOTS, activation=activation)
        state.fused_projections = plain_projections(mlp)
        state.act_module = mlp.act_fn
        set_state(self, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = state_of(self)
        if not follows_activation(state, self.act_fn):
            return state.plain(x)
        gate_proj, up_proj, down = self.gate_proj, self.up_proj, self.down_proj
        if not plain_projections(self):
            if state.fused_projections:
                _warn_replaced(self, state)
            # The projections run as their own (possibly patched) modules, in the stock order:
            # a dropout inside one (LoRA's) must draw at the same point in every pass.
            gate, up = gate_proj(x), up_proj(x)
            if wants_backward(self, gate, up):
                return down(gated_down(state, gate, up, None))
            keep_rng_stream(self, state.codecs["gate"], state.codecs["up"])
            return down(self.act_fn(gate) * up)
        if not wants_backward(self, x, *self.parameters()):
            packs_x = [
                state.codecs["input"] for p in (gate_proj, up_proj) if p.weight.requires_grad
            ]
            keep_rng_stream(self, *packs_x, state.codecs["gate"], state.codecs["up"])
            return state.plain(x)
        # gate and up share one packed x through the cache; a frozen weight keeps nothing.
        gate = linear_keeping_input(x, gate_proj.weight, gate_proj.bias, state, "input")
        up = linear_keeping_input(x, up_proj.weight, up_proj.bias, state, "input")
        return gated_down(state, gate, up, down)

    def extra_repr(self) -> str:
        return _describe(state_of(self))


class CompressedFusedGatedMLP(nn.Module):
    """Phi-3's gated MLP, ``down(up * act(gate))`` with ``gate, up = gate_up_proj(x).chunk(2)``,
    sharing the submodules of ``mlp``.

    The activation's input is a view of the fused projection's output, which the product keeps
    alive anyway, so only a fused op can drop it: the product op keeps the few-bit code and the
    operands (compressed with ``codec``, or compacted exact copies with
    :class:`~hf_actq.codecs.packed.ExactCodec`); ``linear_codec`` compresses the fused
    projection's input (None leaves that projection a plain linear).
    """

    def __init__(
        self,
        mlp: nn.Module,
        codec: Codec | None = None,
        activation_bits: int = 3,
        cache: PackCache | None = None,
        linear_codec: Codec | None = None,
    ) -> None:
        found = activation_of(getattr(mlp, "activation_fn", None))
        if not is_fused_gated_mlp(mlp) or found is None:
            raise ValueError(
                "CompressedFusedGatedMLP needs nn.Linear gate_up_proj and down_proj and a "
                f"supported activation_fn; got {type(mlp).__name__}"
            )
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.activation_fn = mlp.activation_fn
        activation = ActivationTable(found[0], activation_bits, found[1])
        state = default_state(mlp.forward, codec, cache, CODEC_SLOTS, activation=activation)
        state.codecs["input"] = linear_codec
        state.act_module = mlp.activation_fn
        set_state(self, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = state_of(self)
        fused, down = self.gate_up_proj, self.down_proj
        if not follows_activation(state, self.activation_fn):
            return state.plain(x)
        if not is_fused_gated_mlp(self):
            _warn_replaced(self, state)
            return state.plain(x)
        input_codec = state.codecs.get("input")
        if not wants_backward(self, x, *self.parameters()):
            packs_x = input_codec if fused.weight.requires_grad else None
            keep_rng_stream(self, packs_x, state.codecs["gate"], state.codecs["up"])
            return state.plain(x)
        if input_codec is not None:
            gate_up = linear_keeping_input(x, fused.weight, fused.bias, state, "input")
        else:
            gate_up = F.linear(x, fused.weight, fused.bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return gated_down(state, gate, up, down)

    def extra_repr(self) -> str:
        return _describe(state_of(self))


class CompressedT5GatedMLP(nn.Module):
    """T5 v1.1's gated feed-forward (``T5DenseGatedActDense`` and its copies in mT5 and others):
    ``wo(dropout(act(wi_0(x)) * wi_1(x)))``, sharing the submodules of ``mlp``.

    The dropout between the product and ``wo`` keeps a fused op from rebuilding ``wo``'s input,
    so the projections and the dropout run as their own (patched) modules, in the stock order,
    and only the product is fused: it keeps the few-bit code of act'(gate) and compressed
    act(gate) and up, where stock keeps act's input and act(gate) and up exact.
    """

    def __init__(
        self,
        mlp: nn.Module,
        codec: Codec | None = None,
        activation_bits: int = 3,
        cache: PackCache | None = None,
    ) -> None:
        found = t5_gated_activation(mlp)
        if found is None:
            raise ValueError(
                "CompressedT5GatedMLP needs wi_0, wi_1, wo, dropout and a supported act; got "
                f"{type(mlp).__name__}"
            )
        super().__init__()
        self.wi_0, self.wi_1, self.wo = mlp.wi_0, mlp.wi_1, mlp.wo
        self.act, self.dropout = mlp.act, mlp.dropout
        activation = ActivationTable(found[0], activation_bits, found[1])
        state = default_state(mlp.forward, codec, cache, ("gate", "up"), activation=activation)
        state.act_module = mlp.act
        set_state(self, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = state_of(self)
        if not follows_activation(state, self.act):
            return state.plain(x)
        gate, up = self.wi_0(x), self.wi_1(x)
        if wants_backward(self, gate, up):
            hidden = gated_down(state, gate, up, None)
        else:
            keep_rng_stream(self, state.codecs["gate"], state.codecs["up"])
            hidden = self.act(gate) * up
        hidden = self.dropout(hidden)
        # As T5 does: run wo in its weight's dtype (fp32 wo in a bf16 model), unless quantized.
        weight = self.wo.weight
        if (
            isinstance(weight, torch.Tensor)
            and hidden.dtype != weight.dtype
            and weight.dtype != torch.int8
        ):
            hidden = hidden.to(weight.dtype)
        return self.wo(hidden)

    def extra_repr(self) -> str:
        return _describe(state_of(self))


def t5_gated_activation(module: nn.Module):
    """``(name, params)`` of a T5 v1.1-style gated feed-forward's activation, or None."""
    names = ("wi_0", "wi_1", "wo", "dropout", "act")
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in names):
        return None
    return activation_of(module.act)


def _describe(state: OpState) -> str:
    codecs = ", ".join(f"{slot}={codec!r}" for slot, codec in state.codecs.items())
    return f"{codecs}, act={state.activation.describe()}"


def is_fused_gated_mlp(module: nn.Module) -> bool:
    return runs_as_linear(getattr(module, "gate_up_proj", None)) and runs_as_linear(
        getattr(module, "down_proj", None)
    )
