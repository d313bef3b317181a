"""Mixture-of-experts experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): transformers 5 stores the
experts as fused 3-D weights (``gate_up_proj`` [experts, 2 * inter, hidden], ``down_proj``
[experts, hidden, inter]) and dispatches their forward through ``ExpertsInterface``.

Stock grouped-matmul autograd keeps, per routed (token, expert) pair: the gathered input (top-k
copies of every token), the gate projection (for the activation), act(gate) and up (for the
product), the product (for the down projection) and the down projection's output (for the
routing weights' gradient). Here, per pair, only the few-bit code of act'(gate) and compressed
act(gate) and up; the input once per token where the experts' weights train (packed as a
linear layer's input, the pack the router's linear keeps too: :mod:`hf_actq.ops.moe_router`),
nothing of it where they are frozen. Backward rebuilds the product from the operands and the
down output from the product (one extra grouped matmul) to differentiate the routing weights.
The router's softmax and top-k stay exact.

The forward runs transformers' own grouped matmuls in the stock order, so the output equals the
"grouped_mm" implementation's bit for bit. Experts of other layouts and gates (gpt-oss's):
:mod:`hf_actq.ops.moe_experts_recomputed`, through the same ``ExpertsInterface`` function.
"""

from __future__ import annotations

import torch

from hf_actq.kernels import fewbit_backward
from hf_actq.ops import moe_experts_recomputed as recomputed
from hf_actq.ops.gated_mlp import product_backward, product_forward
from hf_actq.ops.moe_routing import (
    combine,
    factor_inputs,
    grouped_linear,
    grouped_mm_backward,
    input_rows,
    keep_input,
    keep_weights,
    kept_input,
    kept_weights,
    op_weights,
    route,
    weight_grads,
)
from hf_actq.ops.slots import observer
from hf_actq.ops.state import STATE, keep_rng_stream, once_differentiable, wants_backward

EXPERTS_NAME = "hf_actq_experts"
SLOTS = ("act", "gate", "up")


class CompressedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index, state, refolds,
        *factors,
    ):  # fmt: skip
        # factors: each weight's LoRA (lhs, rhs) where backward takes it as base + rank-r path
        # (moe_routing.LowRankWeight), inputs for their gradients; Nones for the others.
        from transformers.integrations.moe import _grouped_linear

        _, perm, offsets = route(top_k_index, gate_up_proj.shape[0])
        token_of_row = perm // top_k_index.shape[1]  # rows sorted by expert -> their token
        weight_of_row = top_k_weights.reshape(-1)[perm]

        gate, up = _grouped_linear(hidden_states[token_of_row], gate_up_proj, offsets).chunk(2, -1)
        act = state.activation
        watcher = observer()
        if watcher is not None:
            watcher.on_fewbit(state.slot_id("act"), gate, act)
        levels = act.tensors(gate.device)[1]
        # act(gate), the product and both packs in one kernel where it runs (gated_mlp): gate
        # and up are read in place, as the halves of the projection's output.
        fused = product_forward(state, gate, up)
        if fused is None:
            activated, codes, nan_flag = act.forward_and_codes(gate)
            product = activated * up
        else:
            product, codes, nan_flag, packed_a, packed_up = fused
        out = _grouped_linear(product, down_proj, offsets) * weight_of_row.unsqueeze(-1)
        del product
        output = combine(out, perm, top_k_index.shape).to(hidden_states.dtype)

        if fused is None:
            packed_a, packed_up = state.pack(activated, "gate"), state.pack(up, "up")
        ctx.headers = (packed_a.with_tensors(()), packed_up.with_tensors(()))
        ctx.split, ctx.bits = len(packed_a.tensors), act.bits
        ctx.input_dtype = hidden_states.dtype
        kept = keep_weights(ctx, (gate_up_proj, down_proj), refolds)
        # Routing as int32 rows; the input last, where the gate_up weight trains (inputs 2, 7, 8).
        ctx.save_for_backward(
            weight_of_row,
            *kept[:2],
            perm.to(torch.int32),
            offsets,
            codes,
            levels,
            nan_flag,
            *packed_a.tensors,
            *packed_up.tensors,
            *kept[2:],  # the low-rank weights' parts
            *keep_input(ctx, state, hidden_states, (2, 7, 8)),
        )
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor only once
        saved, load_input = kept_input(ctx, saved)
        saved, low_rank = saved[:-6], saved[-6:]
        saved = (load_input, saved[0], *kept_weights(ctx, saved[1:3], low_rank), *saved[3:])
        (
            load_input,
            weight_of_row,
            gate_up_proj,
            down_proj,
            perm,
            offsets,
            codes,
            levels,
            nan_flag,
        ) = saved[:9]
        buffers = saved[9:]
        header_a, header_up = ctx.headers
        packed_a = header_a.with_tensors(buffers[: ctx.split])
        packed_up = header_up.with_tensors(buffers[ctx.split :])
        dtype = grad_output.dtype
        perm = perm.long()
        top_k = weight_of_row.numel() // ctx.input_shape[0]
        token_of_row = perm // top_k
        grad_rows = grad_output[token_of_row]
        grad_out_rows = grad_rows * weight_of_row.to(dtype).unsqueeze(-1)
        if torch.compiler.is_compiling():
            a_hat, up_hat = packed_a.unpack().to(dtype), packed_up.unpack().to(dtype)
            product = a_hat * up_hat
            grad_top_k_weights = _routing_grad(ctx, product, grad_rows, saved)
            hats = (a_hat, up_hat, product)
            grads = _traced_backward(ctx, saved, grad_out_rows, token_of_row, hats)
            return grads[0], grad_top_k_weights, *grads[1:], None, None, None, *(None,) * 4
        grad_product = grouped_linear(grad_out_rows, down_proj, offsets, is_transposed=True)
        # Each weight's gradient, or its LoRA factors' (inputs 7-10).
        needs_gate_up = any(ctx.needs_input_grad[i] for i in (2, 7, 8))
        needs_down = any(ctx.needs_input_grad[i] for i in (3, 9, 10))
        # act(gate) and up read from their packs by one kernel where it takes them (gated_mlp),
        # with the product, which the routing weights' and the down projection's gradients need.
        with_product = ctx.needs_input_grad[1] or needs_down
        grad_gate, grad_up, product = product_backward(
            grad_product, packed_a, packed_up, codes, levels, nan_flag, ctx.bits, with_product
        )
        grad_gate_up = torch.cat([grad_gate.to(dtype), grad_up], dim=-1)
        del grad_gate, grad_up
        grad_top_k_weights = _routing_grad(ctx, product, grad_rows, saved)

        grad_gate_up_proj = grad_down_proj = grad_hidden = None
        factor_grads = [None] * 4
        if needs_gate_up:
            # Gathered only now, after the [rows, intermediate] temporaries above (the peak).
            rows = input_rows(ctx, load_input, token_of_row, dtype)
            grad_gate_up_proj, factor_grads[:2] = weight_grads(
                gate_up_proj, grad_gate_up, rows, offsets, transposed=False
            )
            del rows
        if needs_down:
            grad_down_proj, factor_grads[2:] = weight_grads(
                down_proj, grad_out_rows, product, offsets, transposed=False
            )
        if ctx.needs_input_grad[0]:
            grad_rows_in = grouped_linear(grad_gate_up, gate_up_proj, offsets, is_transposed=True)
            grad_hidden = grad_output.new_zeros(ctx.input_shape, dtype=dtype)
            grad_hidden.index_add_(0, token_of_row, grad_rows_in)
            grad_hidden = grad_hidden.to(ctx.input_dtype)
        grads = (grad_hidden, grad_top_k_weights, grad_gate_up_proj, grad_down_proj)
        return *grads, None, None, None, *factor_grads


def _routing_grad(ctx, product, grad_rows, saved):
    """The routing weights' gradient, from the down projection's output rebuilt from the
    product (None where they need none)."""
    if not ctx.needs_input_grad[1]:
        return None
    _, weight_of_row, _, down_proj, perm, offsets = saved[:6]
    out = grouped_linear(product, down_proj, offsets)
    grad_weight_of_row = (grad_rows * out).sum(-1)
    grad = torch.empty_like(grad_weight_of_row)
    grad[perm.long()] = grad_weight_of_row
    return grad.view(ctx.input_shape[0], -1).to(weight_of_row.dtype)


def _grad_gate_up(ctx, grad_product, a_hat, up_hat, saved):
    """The gradient of the gate and up projections' output, [rows, 2 x intermediate]."""
    codes, levels, nan_flag = saved[6:9]
    grad_up = grad_product * a_hat
    grad_gate = fewbit_backward(grad_product * up_hat, codes, levels, nan_flag, ctx.bits)
    return torch.cat([grad_gate.to(grad_product.dtype), grad_up], dim=-1)


def _traced_backward(ctx, saved, grad_out_rows, token_of_row, hats):
    """The backward in a torch.compile trace: the grouped matmuls' input and weight gradients
    through one opaque operator (:func:`~hf_actq.ops.moe_routing.grouped_mm_backward`), as
    their per-expert shapes depend on the routed counts, which a trace cannot follow."""
    a_hat, up_hat, product = hats
    load_input, _, gate_up_proj, down_proj, _, offsets = saved[:6]
    dtype = grad_out_rows.dtype
    # Each projection as the operator takes it: rows @ weight[e], weight [experts, in, out].
    grad_product, grad_down = grouped_mm_backward(
        product, down_proj.to(dtype).transpose(-2, -1), offsets, grad_out_rows
    )
    grad_gate_up = _grad_gate_up(ctx, grad_product, a_hat, up_hat, saved)
    rows = input_rows(ctx, load_input, token_of_row, dtype)
    grad_rows_in, grad_gate_up_weight = grouped_mm_backward(
        rows, gate_up_proj.to(dtype).transpose(-2, -1), offsets, grad_gate_up
    )
    grad_hidden = grad_rows_in.new_zeros(ctx.input_shape).index_add_(0, token_of_row, grad_rows_in)
    return (
        grad_hidden.to(ctx.input_dtype),
        grad_gate_up_weight.transpose(-2, -1).to(gate_up_proj.dtype),
        grad_down.transpose(-2, -1).to(down_proj.dtype),
    )


def compressed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An ``ExpertsInterface`` implementation: the compressed op for experts ``hf_actq.apply``
    patched, whenever autograd records; otherwise the implementation the model ran before."""
    state = self.__dict__.get(STATE)
    if state is not None and "gate_up" in state.codecs:  # patched for the gate recomputed
        if not recomputed.supports_recomputed_gate(self, parameters=False):
            return _fallback(self, state)(self, hidden_states, top_k_index, top_k_weights)
        if not wants_backward(self, hidden_states, top_k_weights, *self.parameters()):
            keep_rng_stream(self, state.codecs["gate_up"])
            return _fallback(self, state)(self, hidden_states, top_k_index, top_k_weights)
        return recomputed.recomputed_gate_experts(
            self, hidden_states, top_k_index, top_k_weights, state
        )
    if state is None or not supports_experts(self):
        return _fallback(self, state)(self, hidden_states, top_k_index, top_k_weights)
    weights = (self.gate_up_proj, self.down_proj)
    if not wants_backward(self, hidden_states, top_k_weights, *weights):
        keep_rng_stream(self, state.codecs["gate"], state.codecs["up"])
        return _fallback(self, state)(self, hidden_states, top_k_index, top_k_weights)
    weights, refolds = op_weights(self, ("gate_up_proj", "down_proj"), weights, state)
    return CompressedExpertsFunction.apply(
        hidden_states, top_k_weights, *weights, top_k_index, state, refolds, *factor_inputs(refolds)
    )


def _fallback(module, state):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = type(module).forward.__wrapped__
    name = state.experts_fallback if state is not None else None
    return ALL_EXPERTS_FUNCTIONS.get_interface(name or "eager", original)


def supports_experts(module) -> bool:
    """Whether ``module`` is a transformers experts module of the layout this op computes:
    concatenated [gate; up] 3-D weights, not transposed, no biases, the default gating, no
    post-expert norm, no expert parallelism. Older transformers (5.17) has neither of the last two,
    nor the flags that say so: an absent flag means an absent feature."""
    from transformers.integrations.moe import _default_apply_gate

    def is_3d(name):
        value = getattr(module, name, None)
        return isinstance(value, torch.Tensor) and value.dim() == 3

    return (
        is_3d("gate_up_proj")
        and is_3d("down_proj")
        and getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "is_transposed", True)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "has_post_expert_norm", False)
        and not getattr(module, "_is_expert_parallel", False)
        and getattr(type(module), "_apply_gate", None) is _default_apply_gate
    )


def register_experts(name: str = EXPERTS_NAME) -> str:
    """Register :func:`compressed_experts_forward` with transformers' ``ExpertsInterface``;
    returns the name for ``config._experts_implementation``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, compressed_experts_forward)
    return name
