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

ATTENTION_NAME = "hf_actq_eager"


def _keep_mask(shape, p, seed, device):
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.rand(shape, device=device, generator=generator) >= p


class _Slot:
    """Where one tensor's buffers sit in the saved tensors, and how to rebuild it.

    It holds no tensor itself: everything goes through ``ctx.save_for_backward``.
    """

    def __init__(self, codec: Codec | None):
        self.codec, self.header, self.start, self.count = codec, None, 0, 0

    def keep(self, x: torch.Tensor, saved: list, cache: PackCache) -> None:
        self.start = len(saved)
        if self.codec is None:
            saved.append(x)
        else:
            packed = cache.pack(x, self.codec)
            self.header = packed.with_tensors(())
            saved.extend(packed.tensors)
        self.count = len(saved) - self.start

    def restore(self, saved) -> torch.Tensor:
        own = saved[self.start : self.start + self.count]
        return own[0] if self.header is None else self.header.with_tensors(own).unpack()


class CompressedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, scaling, dropout, codecs, cache):
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        seed = None
        dropped = probs
        if dropout > 0.0:
            seed = draw_seed()
            keep = _keep_mask(probs.shape, dropout, seed, probs.device)
            dropped = probs * keep * (1.0 / (1.0 - dropout))
        out = torch.matmul(dropped, value)

        saved: list = []
        slots = {}
        for name, tensor in (("q", query), ("k", key), ("v", value), ("probs", probs)):
            slots[name] = _Slot(codecs.get(name))
            slots[name].keep(tensor, saved, cache)
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
            keep = _keep_mask(probs.shape, ctx.dropout, ctx.seed, probs.device)
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
        return grad_q, grad_k, grad_v, None, None, None, None, None


DEFAULT_CODECS: dict[str, Codec | None] = {}


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
    default the module's ``hf_actq_attention_codecs`` attribute, else all exact.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    if codecs is None:
        codecs = getattr(module, "hf_actq_attention_codecs", DEFAULT_CODECS)
    p = dropout if module is None or module.training else 0.0
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if not needs_grad:
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p=p, training=p > 0)
        out = torch.matmul(weights, value)
    else:
        out, weights = CompressedAttentionFunction.apply(
            query,
            key,
            value,
            attention_mask,
            float(scaling),
            float(p),
            codecs,
            cache if cache is not None else DEFAULT_CACHE,
        )
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
