"""Mixture-of-experts experts of any layout and gate (tested: gpt-oss, Aria, Nemotron-H, and
Mixtral's layout with an activation no few-bit table covers): transposed weights, biases,
interleaved gate and up, and a gate function of the model's own (``_apply_gate``: gpt-oss's
clamped GLU ``(clamp(up) + 1) * g * sigmoid(1.702 g)`` with ``g = clamp(gate)``) or a plain
activation for experts without a gate.

Stock grouped-matmul autograd keeps, per routed (token, expert) pair, the gathered input, the
projection's output and every intermediate of the gate function (gpt-oss's: six tensors of the
intermediate width), the product and the down projection's output. Here only the projection's
output, packed with the config's codec (``gate_up`` slot; exact under an activations-only
config), and the input as :mod:`hf_actq.ops.moe_experts` keeps it. Backward unpacks
the projection's output, runs the gate function on it again (elementwise: cheap next to the
grouped matmuls) and differentiates it there, so any gate the model defines takes its exact
derivative at the rebuilt point; the down output, for the routing weights' gradient, is rebuilt
from the product. The router as for :mod:`hf_actq.ops.moe_experts`.

The forward runs transformers' grouped matmuls, bias additions and gate in the stock order, so the
output equals the "grouped_mm" implementation's bit for bit.
"""

from __future__ import annotations

import torch

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
from hf_actq.ops.state import once_differentiable

# The experts' own parameters this op takes as inputs (transformers' names); experts with any
# other parameter (one a gate function might read) are not claimed.
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class RecomputedGateExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden_states, top_k_weights, up_weight, up_bias, down_weight, down_bias, *rest
    ):
        from transformers.integrations.moe import _grouped_linear

        # factors: each weight's LoRA (lhs, rhs) where backward takes it as base + rank-r path
        # (moe_routing.LowRankWeight), inputs for their gradients; Nones for the others.
        top_k_index, module, state, refolds, *factors = rest
        transposed = module.is_transposed
        expert_ids, perm, offsets = route(top_k_index, up_weight.shape[0])
        token_of_row = perm // top_k_index.shape[1]  # rows sorted by expert -> their token
        weight_of_row = top_k_weights.reshape(-1)[perm]

        projection = _grouped_linear(
            hidden_states[token_of_row],
            up_weight,
            offsets,
            bias=None if up_bias is None else up_bias[expert_ids],
            is_transposed=transposed,
        )
        packed = state.pack(projection, "gate_up")
        # An exact pack is the projection itself (a trace reads no version: it functionalizes).
        version = None if torch.compiler.is_compiling() else projection._version
        product = gate_function(module)(projection)
        if version is not None and projection._version != version:
            raise RuntimeError(
                f"{type(module).__name__}'s gate function changed its input in place, which "
                "the experts op keeps for backward: skip the module in hf_actq "
                "(ActQConfig(skip_modules=[...])) or make the gate out of place"
            )
        del projection
        out = _grouped_linear(
            product,
            down_weight,
            offsets,
            bias=None if down_bias is None else down_bias[expert_ids],
            is_transposed=transposed,
        )
        del product
        output = combine(out * weight_of_row.unsqueeze(-1), perm, top_k_index.shape)

        ctx.header, ctx.module = packed.with_tensors(()), module
        ctx.input_dtype = hidden_states.dtype
        up_kept, down_kept, *low_rank = keep_weights(ctx, (up_weight, down_weight), refolds)
        ctx.save_for_backward(
            weight_of_row,
            up_kept,
            up_bias,
            down_kept,
            down_bias,
            perm.to(torch.int32),
            offsets,
            *packed.tensors,
            *low_rank,  # the low-rank weights' parts
            *keep_input(ctx, state, hidden_states, (2, 10, 11)),  # where the up weight trains
        )
        return output.to(hidden_states.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor only once
        saved, load_input = kept_input(ctx, saved)
        saved, low_rank = saved[:-6], saved[-6:]
        up_weight, down_weight = kept_weights(ctx, (saved[1], saved[3]), low_rank)
        saved = (load_input, saved[0], up_weight, saved[2], down_weight, *saved[4:])
        load_input, weight_of_row, _, up_bias, _, down_bias, perm, offsets = saved[:8]
        module, transposed = ctx.module, ctx.module.is_transposed
        dtype = grad_output.dtype
        perm = perm.long()
        top_k = weight_of_row.numel() // ctx.input_shape[0]
        token_of_row = perm // top_k
        # The expert of each sorted row, from the spans' ends (no host read of the counts).
        rows = torch.arange(perm.numel(), device=perm.device, dtype=offsets.dtype)
        expert_ids = torch.searchsorted(offsets, rows, right=True)
        grad_rows = grad_output[token_of_row]
        grad_out_rows = grad_rows * weight_of_row.to(dtype).unsqueeze(-1)

        # The gate function again, on the rebuilt projection, and its exact derivative there.
        projection = ctx.header.with_tensors(saved[8:]).unpack().detach()
        if torch.compiler.is_compiling():
            grads = _traced_backward(ctx, saved, grad_out_rows, grad_rows, expert_ids, projection)
            return *grads, None, None, None, None, *(None,) * 4
        with torch.enable_grad():
            projection.requires_grad_()
            product = gate_function(module)(projection)
        # A weight [experts, out, in] (not transposed) takes the gradient as x @ W[e].
        grad_product = grouped_linear(
            grad_out_rows, down_weight, offsets, is_transposed=not transposed
        )
        (grad_projection,) = torch.autograd.grad(
            product, projection, grad_product.to(product.dtype)
        )
        del grad_product
        product, grad_projection = product.detach().to(dtype), grad_projection.to(dtype)
        del projection

        grads, factor_grads = [None] * 6, [None] * 4
        if ctx.needs_input_grad[1]:
            out = grouped_linear(
                product,
                down_weight,
                offsets,
                bias=None if down_bias is None else down_bias[expert_ids].to(dtype),
                is_transposed=transposed,
            )
            grad_weight_of_row = torch.empty_like(out[:, 0])
            grad_weight_of_row[perm] = (grad_rows * out).sum(-1)
            del out
            grads[1] = grad_weight_of_row.view(ctx.input_shape[0], -1).to(weight_of_row.dtype)
        # Each weight's gradient, or its LoRA factors' (inputs 10-13).
        if any(ctx.needs_input_grad[i] for i in (4, 12, 13)):
            grads[4], factor_grads[2:] = weight_grads(
                down_weight, grad_out_rows, product, offsets, transposed
            )
        if ctx.needs_input_grad[5]:
            grads[5] = _bias_grad(grad_out_rows, expert_ids, down_bias)
        del product
        if ctx.needs_input_grad[3]:
            grads[3] = _bias_grad(grad_projection, expert_ids, up_bias)
        # Gathered only now, after the [rows, intermediate] temporaries above (the step's peak).
        if any(ctx.needs_input_grad[i] for i in (2, 10, 11)):
            rows_in = input_rows(ctx, load_input, token_of_row, dtype)
            grads[2], factor_grads[:2] = weight_grads(
                up_weight, grad_projection, rows_in, offsets, transposed
            )
            del rows_in
        if ctx.needs_input_grad[0]:
            grad_rows_in = grouped_linear(
                grad_projection, up_weight, offsets, is_transposed=not transposed
            )
            grad_hidden = grad_output.new_zeros(ctx.input_shape, dtype=dtype)
            grad_hidden.index_add_(0, token_of_row, grad_rows_in)
            grads[0] = grad_hidden.to(ctx.input_dtype)
        return *grads, None, None, None, None, *factor_grads


def _traced_backward(ctx, saved, grad_out_rows, grad_rows, expert_ids, projection):
    """The backward in a torch.compile trace: the gate differentiated by ``torch.func.vjp``
    (which a trace follows, and ``autograd.grad`` it does not), the grouped matmuls' gradients
    through one opaque operator (:func:`~hf_actq.ops.moe_routing.grouped_mm_backward`), as
    their per-expert shapes depend on the routed counts, which a trace cannot follow."""
    from transformers.integrations.moe import _grouped_linear

    load_input, weight_of_row, up_weight, up_bias, down_weight, down_bias, perm, offsets = saved[:8]
    module, transposed = ctx.module, ctx.module.is_transposed
    dtype = grad_out_rows.dtype

    def in_out(weight):  # each projection as the operator takes it: rows @ weight[e]
        weight = weight.to(dtype)
        return weight if transposed else weight.transpose(-2, -1)

    def layout(grad, weight):
        return (grad if transposed else grad.transpose(-2, -1)).to(weight.dtype)

    product, gate_vjp = torch.func.vjp(gate_function(module), projection)
    product = product.to(dtype)
    grad_product, grad_down = grouped_mm_backward(
        product, in_out(down_weight), offsets, grad_out_rows
    )
    (grad_projection,) = gate_vjp(grad_product.to(projection.dtype))
    grad_projection = grad_projection.to(dtype)
    out = _grouped_linear(product, in_out(down_weight), offsets, is_transposed=True)
    if down_bias is not None:
        out = out + down_bias[expert_ids].to(dtype)
    grad_weight_of_row = torch.empty_like(out[:, 0])
    grad_weight_of_row[perm.long()] = (grad_rows * out).sum(-1)
    token_of_row = perm.long() // (weight_of_row.numel() // ctx.input_shape[0])
    rows = input_rows(ctx, load_input, token_of_row, dtype)
    grad_rows_in, grad_up = grouped_mm_backward(rows, in_out(up_weight), offsets, grad_projection)
    grad_hidden = grad_rows_in.new_zeros(ctx.input_shape).index_add_(0, token_of_row, grad_rows_in)
    return (
        grad_hidden.to(ctx.input_dtype),
        grad_weight_of_row.view(ctx.input_shape[0], -1).to(weight_of_row.dtype),
        layout(grad_up, up_weight),
        None if up_bias is None else _bias_grad(grad_projection, expert_ids, up_bias),
        layout(grad_down, down_weight),
        None if down_bias is None else _bias_grad(grad_out_rows, expert_ids, down_bias),
    )


def _bias_grad(grad_rows, expert_ids, bias):
    """Each expert's bias gradient: the sum of its rows' gradients."""
    grad = torch.zeros(bias.shape, dtype=grad_rows.dtype, device=grad_rows.device)
    return grad.index_add_(0, expert_ids, grad_rows).to(bias.dtype)


def gate_function(module):
    """What the experts apply between their two projections: their gate function over the
    projection's output (both halves), or, for experts without a gate, their activation."""
    return module._apply_gate if module.has_gate else module.act_fn


def projection_names(module) -> tuple[str, str | None]:
    """The first projection's weight and bias names (``gate_up_proj``, or ``up_proj`` for experts
    without a gate)."""
    name = "gate_up_proj" if module.has_gate else "up_proj"
    return name, (f"{name}_bias" if module.has_bias else None)


def recomputed_gate_experts(module, hidden_states, top_k_index, top_k_weights, state):
    up_name, up_bias_name = projection_names(module)
    weights = (getattr(module, up_name), module.down_proj)
    (up_weight, down_weight), refolds = op_weights(module, (up_name, "down_proj"), weights, state)
    return RecomputedGateExpertsFunction.apply(
        hidden_states,
        top_k_weights,
        up_weight,
        None if up_bias_name is None else getattr(module, up_bias_name),
        down_weight,
        module.down_proj_bias if module.has_bias else None,
        top_k_index,
        module,
        state,
        refolds,
        *factor_inputs(refolds),
    )


def supports_recomputed_gate(module, parameters: bool = True) -> bool:
    """Whether this op computes ``module``: transformers experts with 3-D weights, no
    post-expert norm, no expert parallelism, and (``parameters``: checked when ``apply`` claims
    the module, not on every forward) no parameter besides the projections' weights and biases
    (a gate function that read one would lose its gradient)."""

    def is_3d(name):
        value = getattr(module, name, None)
        return isinstance(value, torch.Tensor) and value.dim() == 3

    if getattr(module, "has_post_expert_norm", False) or getattr(
        module, "_is_expert_parallel", False
    ):
        return False
    up_name, _ = projection_names(module)
    if not (is_3d(up_name) and is_3d("down_proj")):
        return False
    if not module.has_gate and not callable(getattr(module, "act_fn", None)):
        return False
    if not parameters:
        return True
    own = {name.split(".")[0] for name, _ in module.named_parameters()}
    # PEFT's parametrized experts keep the weights under ``parametrizations``.
    return own <= {*_WEIGHTS, *_BIASES, "parametrizations"}
