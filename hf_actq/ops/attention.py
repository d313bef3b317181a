"""Attention that keeps compressed operands, in two layouts.

SDPA (every registered model that runs SDPA, decoders and encoders): keeps packed q, k, v and,
under attention dropout, the RNG state the mask was drawn from; backward rebuilds q, k, v and
differentiates PyTorch's own SDPA on them, so no [S, S] tensor is kept and backward's transients
are those of the fused kernels.

Eager (encoders set to ``attn_implementation="eager"``): eager attention saves q and k (for the
score matmul), the softmax output, the dropout mask, the dropped probabilities and v: four full
tensors of which two are S x S per head. This op keeps q, k, v and the probabilities compressed
and the dropout mask as its RNG seed (8 bytes); each slot can be switched off (kept exact). The
forward output equals ``eager_attention_forward``'s in every element the dropout keeps, with the
same op order.

Both have the signature of transformers' attention functions and register with
``AttentionInterface`` (:func:`register_sdpa_attention`, :func:`register_attention`).
"""

from __future__ import annotations

import torch

from hf_actq.codecs.packed import Codec, capturing_cuda_graph, draw_seed
from hf_actq.ops.dedup import DEFAULT_CACHE, PackCache
from hf_actq.ops.dropout import keep_mask
from hf_actq.ops.state import STATE, OpState, keep_rng_stream, once_differentiable, wants_backward

EAGER_SLOTS = ("q", "k", "v", "probs")
SDPA_SLOTS = ("q", "k", "v")

ATTENTION_NAME = "hf_actq_eager"


class _Slot:
    """Where one tensor's buffers sit in the saved tensors, and how to rebuild it.

    It holds no tensor itself: everything goes through ``ctx.save_for_backward``.
    """

    def __init__(self, codec: Codec | None, transposed: bool = False):
        # An exact slot (``ExactCodec``, or no codec given) keeps the tensor itself: backward
        # takes it as it came, and compacting a transposed q, k or v would copy it.
        if codec is not None and codec.name == "exact":
            codec = None
        self.codec, self.header, self.start, self.count = codec, None, 0, 0
        # Packed as its last two dimensions transposed: K as the score matmul reads it, whose
        # AQ groups and blocks run along the sequence (ALAM's layout).
        self.transposed = transposed and codec is not None

    def keep(self, x: torch.Tensor, saved: list, state: OpState, slot: str) -> None:
        self.start = len(saved)
        if self.codec is None:
            saved.append(x)
        else:
            x = x.transpose(-1, -2) if self.transposed else x
            packed = state.cache.pack(x, self.codec, state.slot_id(slot))
            self.header = packed.with_tensors(())
            saved.extend(packed.tensors)
        self.count = len(saved) - self.start

    def restore(self, saved) -> torch.Tensor:
        own = saved[self.start : self.start + self.count]
        if self.header is None:
            return own[0]
        x = self.header.with_tensors(own).unpack()
        # Back in the layout it came in, last dimension contiguous: SDPA's fused kernels (CPU
        # flash, CUDA flash and memory-efficient) refuse a transposed view and fall back to the
        # math path, which builds the S x S scores (a 1.25x step peak on a LLaMA2-7B slice).
        return x.transpose(-1, -2).contiguous() if self.transposed else x


def _slots(state: OpState, names) -> dict[str, _Slot]:
    return {
        name: _Slot(state.codecs.get(name), name == "k" and state.key_layout == "sequence")
        for name in names
    }


def _dropout_stays_stock(query) -> bool:
    """Attention with dropout runs stock under torch.compile (a trace cannot read the seed this
    op keeps, nor capture and restore RNG states for the replay) and under eager CUDA-graph
    capture (a seed drawn on the host would give every replay the capture's mask)."""
    return torch.compiler.is_compiling() or capturing_cuda_graph(query.device)


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
        slots = _slots(state, EAGER_SLOTS)
        for name, tensor in zip(EAGER_SLOTS, (query, key, value, probs)):
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
        key_layout=state.key_layout if state is not None else "head",
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
    if p > 0.0 and _dropout_stays_stock(query):
        # A trace cannot read the dropout seed this op keeps: the plain form, whose saved
        # tensors the compiler chooses.
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        dropped = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p, training=True)
        return torch.matmul(dropped, value).transpose(1, 2).contiguous(), dropped
    if wants_backward(module, query, key, value):
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


# SDPA path (decoders, and encoders that run SDPA) ---------------------------------------------
SDPA_NAME = "hf_actq_sdpa"


class CompressedSDPAFunction(torch.autograd.Function):
    """Keeps compressed q, k, v (and, with attention dropout, the RNG state the forward drew its
    mask from, as activation checkpointing does); backward rebuilds them and lets PyTorch's own
    SDPA recompute and differentiate the attention: flash or memory-efficient kernels on CUDA,
    the fused CPU kernel where it applies. No [S, S] tensor is kept between forward and backward,
    and backward's transients are one layer's fused attention, not hand-written S x S algebra."""

    @staticmethod
    def forward(ctx, query, key, value, mask, bias, run_sdpa, dropout, state):
        rng = _capture_rng(query.device) if dropout > 0.0 else None
        output = run_sdpa(query, key, value, mask, bias)
        saved: list = []
        slots = _slots(state, SDPA_SLOTS)
        for name, tensor in zip(SDPA_SLOTS, (query, key, value)):
            slots[name].keep(tensor, saved, state, name)
        # The mask is the model's (one for all layers), and so is T5's position bias (computed
        # by the first layer, passed to the others): kept as they are, never per layer, while
        # stock SDPA keeps the per-layer sum of the two.
        ctx.slots, ctx.run_sdpa = slots, run_sdpa
        ctx.has_mask, ctx.has_bias = mask is not None, bias is not None
        ctx.rng_devices = rng[0] if rng is not None else None
        extras = [t for t in (mask, bias) if t is not None]
        ctx.save_for_backward(*saved, *extras, *(rng[1] if rng else []))
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        rng_states = []
        if ctx.rng_devices is not None:
            count = 1 + len(ctx.rng_devices)
            saved, rng_states = saved[:-count], saved[-count:]
        bias = saved.pop() if ctx.has_bias else None
        mask = saved.pop() if ctx.has_mask else None
        q, k, v = (ctx.slots[n].restore(saved).to(grad_out.dtype).detach() for n in ("q", "k", "v"))
        bias_grad = ctx.needs_input_grad[4]
        inputs = (q, k, v, bias.detach()) if bias_grad else (q, k, v)
        if torch.compiler.is_compiling():  # never with dropout (see compressed_sdpa_attention)
            # torch.func.vjp, which a trace follows and autograd.grad it does not; eager keeps
            # autograd.grad, which works under saved-tensor hooks (save_on_cpu) and vjp does not.
            def attend(q, k, v, differentiable_bias=bias):
                return ctx.run_sdpa(q, k, v, mask, differentiable_bias)

            _, vjp = torch.func.vjp(attend, *inputs)
            grads = vjp(grad_out)
        else:
            # Leaves of their own: a shared pack's consumers take one unpacked tensor.
            inputs = tuple(t.detach().requires_grad_() for t in inputs)
            replay = ctx.rng_devices is not None
            with torch.random.fork_rng(devices=ctx.rng_devices or [], enabled=replay):
                if replay:  # the forward's dropout mask, drawn again
                    _restore_rng(ctx.rng_devices, rng_states)
                with torch.enable_grad():
                    output = ctx.run_sdpa(*inputs[:3], mask, inputs[3] if bias_grad else bias)
            grads = torch.autograd.grad(output, inputs, grad_out)
        grad_bias = grads[3] if bias_grad else None
        return (*grads[:3], None, grad_bias, None, None, None)


def _capture_rng(device: torch.device):
    """The generator states a forward's dropout draws from: CPU's, and the device's own."""
    devices = [device] if device.type == "cuda" else []
    states = [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]
    return devices, states


def _restore_rng(devices, states) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1:]):
        torch.cuda.set_rng_state(state, d)


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
    called for the forward, and again in backward to differentiate it), the saved state is
    compressed q, k, v (see :class:`CompressedSDPAFunction`).

    T5's additive ``position_bias`` is an input with its own gradient (the relative-position
    embedding learns through it). Stock SDPA takes its math path for a mask that needs a
    gradient; the forward here runs without grad, so SDPA may pick its fused kernel and the
    output differs from stock by rounding (bf16 autocast, tiny T5: loss 5.3396 vs 5.3411); the
    backward recomputes the math path. A paged cache runs the plain SDPA path with nothing
    compressed.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        # A module of a model hf_actq did not patch, whose config another patched model built
        # from the same config object pointed here: the stock function, as it was.
        (codecs is None and cache is None and STATE not in getattr(module, "__dict__", {}))
        or kwargs.get("cache") is not None
        # A trace cannot capture and restore the RNG state for the dropout replay.
        or (dropout > 0.0 and _dropout_stays_stock(query))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    position_bias = kwargs.pop("position_bias", None)
    # Backward calls this again: it holds no tensor but the mask and bias it is given.
    options = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

    def run_sdpa(q, k, v, mask, bias):
        # transformers folds the bias into the mask itself
        extra = {} if bias is None else {"position_bias": bias}
        return sdpa_attention_forward(
            module,
            q,
            k,
            v,
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **options,
            **extra,
        )[0]

    state = _state(module, codecs, cache)
    if not wants_backward(module, query, key, value, position_bias):
        output = run_sdpa(query, key, value, attention_mask, position_bias)
        keep_rng_stream(module, *(state.codecs.get(name) for name in SDPA_SLOTS))
        return output, None
    output = CompressedSDPAFunction.apply(
        query, key, value, attention_mask, position_bias, run_sdpa, float(dropout), state
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
