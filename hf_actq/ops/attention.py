"""Eager attention (the path BERT/RoBERTa training takes) that keeps compressed operands.

Eager attention saves q and k (for the score matmul), the softmax output, the dropout mask, the
dropped probabilities and v: four full tensors of which two are S x S per head. This op keeps q,
k, v and the probabilities compressed and the dropout mask as its RNG seed (8 bytes); each slot
can be switched off (kept exact). The forward output equals ``eager_attention_forward``'s in
every element the dropout keeps, with the same op order.

``compressed_eager_attention`` has the signature of transformers' attention functions, so it can
be registered with ``AttentionInterface`` (see :func:`register_attention`).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from hf_actq.codecs.packed import Codec, draw_seed
from hf_actq.ops.dedup import DEFAULT_CACHE, PackCache
from hf_actq.ops.dropout import keep_mask
from hf_actq.ops.state import STATE, OpState, keep_rng_stream, wants_backward

EAGER_SLOTS = ("q", "k", "v", "probs")
SDPA_SLOTS = ("q", "k", "v")

ATTENTION_NAME = "hf_actq_eager"


class _Slot:
    """Where one tensor's buffers sit in the saved tensors, and how to rebuild it.

    It holds no tensor itself: everything goes through ``ctx.save_for_backward``.
    """

    def __init__(self, codec: Codec | None):
        self.codec, self.header, self.start, self.count = codec, None, 0, 0

    def keep(self, x: torch.Tensor, saved: list, state: OpState, slot: str) -> None:
        self.start = len(saved)
        if self.codec is None:
            saved.append(x)
        else:
            packed = state.cache.pack(x, self.codec, state.slot_id(slot))
            self.header = packed.with_tensors(())
            saved.extend(packed.tensors)
        self.count = len(saved) - self.start

    def restore(self, saved) -> torch.Tensor:
        own = saved[self.start : self.start + self.count]
        return own[0] if self.header is None else self.header.with_tensors(own).unpack()


def _eager_forward(query, key, value, mask, scaling, dropout):
    """Eager attention's forward; returns the output, the probabilities, the dropped
    probabilities and the dropout seed (one draw, when dropout is on)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    seed = None
    dropped = probs
    if dropout > 0.0:
        seed = draw_seed()
        keep = keep_mask(probs.shape, dropout, seed, probs.device)
        dropped = probs * keep * (1.0 / (1.0 - dropout))
    return torch.matmul(dropped, value), probs, dropped, seed


class CompressedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, dropout, state):
        out, probs, dropped, seed = _eager_forward(query, key, value, mask, scaling, dropout)
        saved: list = []
        slots = {}
        for name, tensor in zip(EAGER_SLOTS, (query, key, value, probs)):
            slots[name] = _Slot(state.codecs.get(name))
            slots[name].keep(tensor, saved, state, name)
        ctx.slots, ctx.seed, ctx.dropout, ctx.scaling = slots, seed, dropout, scaling
        ctx.save_for_backward(*saved)
        return out, dropped

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_weights):
        saved = ctx.saved_tensors
        q, k, v, probs = (ctx.slots[n].restore(saved) for n in ("q", "k", "v", "probs"))
        dtype = grad_out.dtype
        q, k, v, probs = (t.to(dtype) for t in (q, k, v, probs))
        if ctx.dropout > 0.0:
            keep = keep_mask(probs.shape, ctx.dropout, ctx.seed, probs.device)
            scale = 1.0 / (1.0 - ctx.dropout)
            dropped = probs * keep * scale
        else:
            dropped = probs
        grad_v = torch.matmul(dropped.transpose(2, 3), grad_out)
        grad_dropped = torch.matmul(grad_out, v.transpose(2, 3))
        if grad_weights is not None:
            grad_dropped = grad_dropped + grad_weights
        grad_probs = grad_dropped * keep * scale if ctx.dropout > 0.0 else grad_dropped
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        grad_scores = grad_scores * ctx.scaling
        grad_q = torch.matmul(grad_scores, k)
        grad_k = torch.matmul(grad_scores.transpose(2, 3), q)
        return grad_q, grad_k, grad_v, None, None, None, None


def _state(module, codecs, cache) -> OpState:
    """The module's attention state, or one made of the explicit ``codecs`` and ``cache``."""
    state = None if module is None else module.__dict__.get(STATE)
    if state is not None and codecs is None and cache is None:
        return state
    return OpState(
        codecs=codecs if codecs is not None else (state.codecs if state is not None else {}),
        cache=cache if cache is not None else DEFAULT_CACHE,
        path=state.path if state is not None else "",
        attention_fallback=state.attention_fallback if state is not None else None,
    )


def compressed_eager_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    codecs: dict[str, Codec | None] | None = None,
    cache: PackCache | None = None,
    **kwargs,
):
    """Drop-in for transformers' ``eager_attention_forward`` (BERT/RoBERTa layout: q, k, v of
    shape [batch, heads, seq, head_dim]); returns ``(attn_output [b, s, h, d], attn_weights)``.

    ``codecs`` maps "q", "k", "v", "probs" to a codec, or to None to keep that slot exact; by
    default the codecs ``hf_actq.apply`` gave the module, else all exact.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    state = _state(module, codecs, cache)
    training = module is not None and module.training
    p = dropout if module is None or training else 0.0
    if wants_backward(query, key, value):
        out, weights = CompressedAttentionFunction.apply(
            query,
            key,
            value,
            attention_mask,
            float(scaling),
            float(p),
            state,
        )
    elif training:
        # Reentrant checkpointing's first pass: the output and RNG draws of the compressed
        # path (the same dropout mask, the packing seeds), with nothing packed.
        out, _, weights, _ = _eager_forward(query, key, value, attention_mask, scaling, p)
        keep_rng_stream(module, *(state.codecs.get(name) for name in EAGER_SLOTS))
    else:
        if state.attention_fallback == "sdpa":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs
            )
        out, _, weights, _ = _eager_forward(query, key, value, attention_mask, scaling, p)
    return out.transpose(1, 2).contiguous(), weights


def register_attention(name: str = ATTENTION_NAME) -> str:
    """Register :func:`compressed_eager_attention` with transformers under ``name``, for both
    the attention functions and the mask builders (without the second, a custom name gets no
    padding mask). Returns the name to put in ``config._attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, compressed_eager_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return name


# SDPA path (LLaMA-style decoders; no dropout) --------------------------------------------------
SDPA_NAME = "hf_actq_sdpa"


def _sdpa_logits(q, k, scaling, mask, causal):
    """fp32 attention logits of one batch element (heads already aligned)."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    if causal:
        s, t = logits.shape[-2:]
        upper = torch.ones(s, t, dtype=torch.bool, device=logits.device).triu(1)
        logits = logits.masked_fill(upper, float("-inf"))
    if mask is not None:
        logits = (
            logits.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else logits + mask.float()
        )
    return logits


class CompressedSDPAFunction(torch.autograd.Function):
    """Keeps compressed q, k, v (and, when q and k are exact, the fp32 log-sum-exp of each row,
    FlashAttention's statistics); backward recomputes the probabilities from them and needs no
    output copy, since rowsum(dO * O) = rowsum(dP * P)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, causal, groups, run_sdpa, state):
        output = run_sdpa(query, key, value)
        # With q and k exact, backward rebuilds the probabilities from the saved row statistics.
        # With either one lossy, exp(lossy logits - exact lse) is no distribution and blows up
        # where the logit error is positive, so backward renormalises its own logits instead
        # (and nothing is saved for the rows).
        exact_logits = state.codecs.get("q") is None and state.codecs.get("k") is None
        rows = query.shape[:3] if exact_logits else (0,)
        lse = torch.empty(rows, dtype=torch.float32, device=query.device)
        if exact_logits:
            for b in range(query.shape[0]):  # one batch element at a time bounds the S x S buffer
                k = key[b].repeat_interleave(groups, dim=0)
                m = None if mask is None else mask[b if mask.shape[0] > 1 else 0]
                lse[b] = torch.logsumexp(_sdpa_logits(query[b], k, scaling, m, causal), dim=-1)
        saved: list = []
        slots = {}
        for name, tensor in (("q", query), ("k", key), ("v", value)):
            slots[name] = _Slot(state.codecs.get(name))
            slots[name].keep(tensor, saved, state, name)
        ctx.slots, ctx.scaling, ctx.causal, ctx.groups = slots, scaling, causal, groups
        ctx.has_mask, ctx.exact_logits = mask is not None, exact_logits
        ctx.save_for_backward(lse, *([mask] if mask is not None else []), *saved)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        lse, *rest = ctx.saved_tensors
        mask = rest.pop(0) if ctx.has_mask else None
        q, k, v = (ctx.slots[n].restore(rest) for n in ("q", "k", "v"))
        grads = [torch.empty_like(t, dtype=grad_out.dtype) for t in (q, k, v)]
        g_all = grad_out.transpose(1, 2)  # [b, h, s, d]
        for b in range(q.shape[0]):
            k_rep = k[b].repeat_interleave(ctx.groups, dim=0).float()
            v_rep = v[b].repeat_interleave(ctx.groups, dim=0).float()
            m = None if mask is None else mask[b if mask.shape[0] > 1 else 0]
            logits = _sdpa_logits(q[b], k_rep, ctx.scaling, m, ctx.causal)
            row_lse = (lse[b] if ctx.exact_logits else torch.logsumexp(logits, -1)).unsqueeze(-1)
            # A row whose keys are all masked (left padding) has lse = -inf: its probs are 0.
            row_lse = row_lse.masked_fill(torch.isinf(row_lse), 0.0)
            probs = torch.exp(logits - row_lse)
            g = g_all[b].float()
            grad_v = torch.matmul(probs.transpose(-1, -2), g)
            grad_p = torch.matmul(g, v_rep.transpose(-1, -2))
            grad_s = probs * (grad_p - (grad_p * probs).sum(-1, keepdim=True)) * ctx.scaling
            grad_q = torch.matmul(grad_s, k_rep)
            grad_k = torch.matmul(grad_s.transpose(-1, -2), q[b].float())
            heads = k.shape[1]
            grads[0][b] = grad_q
            grads[1][b] = grad_k.view(heads, ctx.groups, *grad_k.shape[1:]).sum(1)
            grads[2][b] = grad_v.view(heads, ctx.groups, *grad_v.shape[1:]).sum(1)
        return (*grads, None, None, None, None, None, None)


def compressed_sdpa_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    codecs: dict[str, Codec | None] | None = None,
    cache: PackCache | None = None,
    **kwargs,
):
    """Drop-in for transformers' ``sdpa_attention_forward``: the output is its output (it is
    called for the forward), the saved state is compressed q, k, v plus an fp32 log-sum-exp.

    Configurations this op does not model (dropout, position bias, paged cache, a query shorter
    than the keys) run the plain SDPA path with nothing compressed.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def run_sdpa(q, k, v):
        return sdpa_attention_forward(
            module,
            q,
            k,
            v,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )

    if (
        dropout > 0.0
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or query.shape[2] != key.shape[2]
    ):
        return run_sdpa(query, key, value)
    state = _state(module, codecs, cache)
    if not wants_backward(query, key, value):
        keep_rng_stream(module, *(state.codecs.get(name) for name in ("q", "k", "v")))
        return run_sdpa(query, key, value)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    groups = query.shape[1] // key.shape[1]
    output = CompressedSDPAFunction.apply(
        query,
        key,
        value,
        attention_mask,
        float(scaling),
        causal,
        groups,
        lambda q, k, v: run_sdpa(q, k, v)[0],
        state,
    )
    return output, None


def register_sdpa_attention(name: str = SDPA_NAME) -> str:
    """Register :func:`compressed_sdpa_attention` (attention and mask interfaces) under
    ``name``; returns it for ``config._attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, compressed_sdpa_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
