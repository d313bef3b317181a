"""DeBERTa-v2/v3 disentangled attention (``DisentangledSelfAttention``) keeping compressed q, k, v.

Stock autograd keeps, per layer, q and k for the content scores, the batch-repeated position
projections and q, k again for the content-to-position and position-to-content terms, the
softmax output, the dropout mask, the dropped probabilities and v: several [batch x heads, S, S]
tensors. Here the attention core (scores, both relative terms, mask, softmax, dropout, the
product with v) runs in forward without keeping anything but packed q, k, v, the relative
embeddings it was given (one [2 x buckets, hidden] tensor) and the RNG state its dropout drew
from; backward rebuilds q, k, v and differentiates the same core again (as the SDPA op does),
so the [S, S] tensors exist one layer at a time, in backward only.

The core is the stock module's own code path (its ``disentangled_attention_bias``, its dropout
module), so the forward output equals the unpatched module's bit for bit.
"""

from __future__ import annotations

import torch

from hf_actq.ops.attention import _capture_rng, _restore_rng, _Slot
from hf_actq.ops.state import once_differentiable, state_of, wants_backward

SLOTS = ("q", "k", "v")


class RecomputedAttentionFunction(torch.autograd.Function):
    """``core(q, k, v, extra)`` keeping packed q, k, v and ``extra`` as given; backward replays
    the forward's RNG state and differentiates ``core`` again. ``params`` are the module's
    trainable parameters the core may use (position projections): their gradients are returned
    too."""

    @staticmethod
    def forward(ctx, core, state, query, key, value, extra, *params):
        rng = _capture_rng(query.device)
        device = query.device.type
        # Backward recomputes under the forward's autocast, as activation checkpointing does.
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.dtypes = (query.dtype, key.dtype, value.dtype)
        output = core(query, key, value, extra)
        saved: list = []
        ctx.slots = {}
        for name, tensor in zip(SLOTS, (query, key, value)):
            ctx.slots[name] = _Slot(state.codecs.get(name))
            ctx.slots[name].keep(tensor, saved, state, name)
        ctx.core, ctx.params, ctx.rng_devices = core, params, rng[0]
        ctx.has_extra = extra is not None
        ctx.save_for_backward(*saved, *([extra] if extra is not None else []), *rng[1])
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        saved = list(ctx.saved_tensors)
        count = 1 + len(ctx.rng_devices)
        saved, rng_states = saved[:-count], saved[-count:]
        extra = saved.pop() if ctx.has_extra else None
        q, k, v = (
            ctx.slots[n].restore(saved).to(dtype).detach().requires_grad_()
            for n, dtype in zip(SLOTS, ctx.dtypes)
        )
        if extra is not None and ctx.needs_input_grad[5]:
            extra = extra.detach().requires_grad_()
        device, autocast, autocast_dtype = ctx.autocast
        with torch.random.fork_rng(devices=ctx.rng_devices):
            _restore_rng(ctx.rng_devices, rng_states)  # the forward's dropout mask, drawn again
            with torch.enable_grad(), torch.autocast(device, autocast_dtype, autocast):
                output = ctx.core(q, k, v, extra)
        inputs = [q, k, v, *([extra] if extra is not None and extra.requires_grad else [])]
        params = [p for p in ctx.params if p.requires_grad]
        grads = list(torch.autograd.grad(output, inputs + params, grad_output, allow_unused=True))
        grad_qkv, grads = grads[:3], grads[3:]
        grad_extra = grads.pop(0) if len(inputs) == 4 else None
        by_param = dict(zip(map(id, params), grads))
        grad_params = [by_param.get(id(p)) for p in ctx.params]
        return (None, None, *grad_qkv, grad_extra, *grad_params)


class CompressedDisentangledSelfAttention(torch.nn.Module):
    """``forward`` bound onto a transformers ``DisentangledSelfAttention`` (DeBERTa-v2/v3)."""

    def forward(
        self,
        hidden_states,
        attention_mask,
        output_attentions=False,
        query_states=None,
        relative_pos=None,
        rel_embeddings=None,
    ):
        from transformers.models.deberta_v2.modeling_deberta_v2 import scaled_size_sqrt

        state = state_of(self)
        # Under torch.compile the stock module (a trace cannot capture and restore the RNG
        # state its dropout replay needs), as the other attention ops do with dropout.
        if (
            output_attentions
            or torch.compiler.is_compiling()
            or not wants_backward(self, hidden_states, *self.parameters())
        ):
            return state.plain(
                hidden_states,
                attention_mask,
                output_attentions,
                query_states=query_states,
                relative_pos=relative_pos,
                rel_embeddings=rel_embeddings,
            )
        if query_states is None:
            query_states = hidden_states
        heads = self.num_attention_heads
        query_layer = self.transpose_for_scores(self.query_proj(query_states), heads)
        key_layer = self.transpose_for_scores(self.key_proj(hidden_states), heads)
        value_layer = self.transpose_for_scores(self.value_proj(hidden_states), heads)
        scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        if self.relative_attention:
            rel_embeddings = self.pos_dropout(rel_embeddings)
        keep = attention_mask.bool()

        def core(query_layer, key_layer, value_layer, rel_embeddings):
            # The stock forward from the projections on, op for op.
            scale = scaled_size_sqrt(query_layer, scale_factor)
            scores = torch.bmm(
                query_layer, key_layer.transpose(-1, -2) / scale.to(dtype=query_layer.dtype)
            )
            if self.relative_attention:
                scores = scores + self.disentangled_attention_bias(
                    query_layer, key_layer, relative_pos, rel_embeddings, scale_factor
                )
            scores = scores.view(-1, heads, scores.size(-2), scores.size(-1))
            scores = scores.masked_fill(~keep, torch.finfo(query_layer.dtype).min)
            probs = self.dropout(torch.nn.functional.softmax(scores, dim=-1))
            context = torch.bmm(probs.view(-1, probs.size(-2), probs.size(-1)), value_layer)
            context = context.view(-1, heads, context.size(-2), context.size(-1))
            context = context.permute(0, 2, 1, 3).contiguous()
            return context.view(context.size()[:-2] + (-1,))

        extra = rel_embeddings if self.relative_attention else None
        params = [p for p in self.parameters() if p.requires_grad]
        context = RecomputedAttentionFunction.apply(
            core, state, query_layer, key_layer, value_layer, extra, *params
        )
        return (context, None)


def is_disentangled_attention(module) -> bool:
    return callable(getattr(module, "disentangled_attention_bias", None)) and all(
        hasattr(module, name) for name in ("query_proj", "key_proj", "value_proj")
    )
