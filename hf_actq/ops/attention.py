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

import sys
from collections.abc import Callable

import torch

from hf_actq.codecs.packed import Codec, capturing_cuda_graph, draw_seed
from hf_actq.ops.dedup import DEFAULT_CACHE, PackCache
from hf_actq.ops.dropout import keep_mask
from hf_actq.ops.gated_output import open_gate_window
from hf_actq.ops.rotary import rotated_pack
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
            # q and k after q/k norms and RoPE: the norms' packs, rotated again in backward.
            packed = None if self.transposed else rotated_pack(state, x, slot, self.codec)
            if packed is None:
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


# Recomputed attention: SDPA (decoders, and encoders that run SDPA), and a decoder's own eager
# function -----------------------------------------------------------------------------------
SDPA_NAME = "hf_actq_sdpa"
EAGER_RECOMPUTE_NAME = "hf_actq_eager_recompute"


class RecomputedAttentionFunction(torch.autograd.Function):
    """Keeps compressed q, k, v (and, with attention dropout, the RNG state the forward drew its
    mask from, as activation checkpointing does); backward rebuilds them and re-runs the
    attention function it was given (``run``), differentiating it: PyTorch's own SDPA (flash or
    memory-efficient kernels on CUDA, the fused CPU kernel where it applies), or a model's own
    eager function (gpt-oss's sinks, Gemma 2's soft-capping). No [S, S] tensor is kept between
    forward and backward; backward's transients are one layer's attention.

    ``extras`` are the tensors besides q, k, v that have a gradient: T5's position bias, a
    module's own parameters that its eager function reads (gpt-oss's sinks); ``run(q, k, v,
    mask, *extras)`` returns the output and the attention weights (None where the function
    gives none). The weights are returned, not kept: stock callers drop them."""

    @staticmethod
    def forward(ctx, query, key, value, mask, run, dropout, state, *extras):
        ctx.set_materialize_grads(False)
        rng = _capture_rng(query.device) if dropout > 0.0 else None
        output, weights = run(query, key, value, mask, *extras)
        saved: list = []
        slots = _slots(state, SDPA_SLOTS)
        for name, tensor in zip(SDPA_SLOTS, (query, key, value)):
            slots[name].keep(tensor, saved, state, name)
        # The mask is the model's (one for all layers), and so is T5's position bias (computed
        # by the first layer, passed to the others): kept as they are, never per layer, while
        # stock SDPA keeps the per-layer sum of the two.
        ctx.slots, ctx.run = slots, run
        ctx.has_mask, ctx.extras = mask is not None, len(extras)
        ctx.rng_devices = rng[0] if rng is not None else None
        masks = [mask] if mask is not None else []
        ctx.save_for_backward(*saved, *masks, *extras, *(rng[1] if rng else []))
        return output, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_weights):
        saved = list(ctx.saved_tensors)
        rng_states = []
        if ctx.rng_devices is not None:
            count = 1 + len(ctx.rng_devices)
            saved, rng_states = saved[:-count], saved[-count:]
        extras = saved[len(saved) - ctx.extras :]
        saved = saved[: len(saved) - ctx.extras]
        mask = saved.pop() if ctx.has_mask else None
        if grad_out is None and grad_weights is None:
            return (None,) * (7 + len(extras))
        q, k, v = (
            ctx.slots[n].restore(saved).to(_dtype_of(grad_out, grad_weights)).detach()
            for n in ("q", "k", "v")
        )
        wanted = [ctx.needs_input_grad[7 + i] for i in range(len(extras))]
        # Leaves of their own: a shared pack's consumers take one unpacked tensor, and a
        # parameter the function reads (through the module) is differentiated as this leaf.
        extras = [e.detach().requires_grad_(w) for e, w in zip(extras, wanted)]
        inputs = (q, k, v, *(e for e, w in zip(extras, wanted) if w))
        if torch.compiler.is_compiling():  # never with dropout (see compressed_sdpa_attention)
            # torch.func.vjp, which a trace follows and autograd.grad it does not; eager keeps
            # autograd.grad, which works under saved-tensor hooks (save_on_cpu) and vjp does not.
            # Only the outputs that have a gradient: a zero [S, S] cotangent for the weights
            # nobody used would be one more transient of that size.
            with_weights = grad_weights is not None

            def attend(q, k, v, *differentiable):
                found = iter(differentiable)
                args = [next(found) if w else e for e, w in zip(extras, wanted)]
                output, weights = ctx.run(q, k, v, mask, *args)
                return (output, weights) if with_weights else output

            outputs, vjp = torch.func.vjp(attend, *inputs)
            if with_weights:
                zeros = outputs[0].new_zeros(()).expand_as(outputs[0])
                grads = vjp((zeros if grad_out is None else grad_out, grad_weights))
            else:
                grads = vjp(grad_out)
        else:
            inputs = tuple(t.requires_grad_() for t in inputs)
            replay = ctx.rng_devices is not None
            with torch.random.fork_rng(devices=ctx.rng_devices or [], enabled=replay):
                if replay:  # the forward's dropout mask, drawn again
                    _restore_rng(ctx.rng_devices, rng_states)
                with torch.enable_grad():
                    outputs = ctx.run(*inputs[:3], mask, *extras)
            pairs = [
                (o, g)
                for o, g in zip(outputs, (grad_out, grad_weights))
                if o is not None and g is not None
            ]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
            )
        found = iter(grads[3:])
        grad_extras = [next(found) if w else None for w in wanted]
        return (*grads[:3], None, None, None, None, *grad_extras)


def _dtype_of(grad_out, grad_weights) -> torch.dtype:
    return (grad_out if grad_out is not None else grad_weights).dtype


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
    compressed q, k, v (see :class:`RecomputedAttentionFunction`).

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

    def run_sdpa(q, k, v, mask, *bias):
        # transformers folds the bias into the mask itself
        extra = {"position_bias": bias[0]} if bias else {}
        output, _ = sdpa_attention_forward(
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
        )
        return output, None

    state = _state(module, codecs, cache)
    extras = () if position_bias is None else (position_bias,)
    if not wants_backward(module, query, key, value, *extras):
        output, _ = run_sdpa(query, key, value, attention_mask, *extras)
        keep_rng_stream(module, *(state.codecs.get(name) for name in SDPA_SLOTS))
        return output, None
    output, _ = RecomputedAttentionFunction.apply(
        query, key, value, attention_mask, run_sdpa, float(dropout), state, *extras
    )
    open_gate_window(state)
    return output, None


def register_sdpa_attention(name: str = SDPA_NAME) -> str:
    """Register :func:`compressed_sdpa_attention` (attention and mask interfaces) under
    ``name``; returns it for ``config._attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, compressed_sdpa_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


def eager_function_of(module) -> Callable | None:
    """The eager attention function transformers runs for ``module`` under
    ``attn_implementation="eager"``: the ``eager_attention_forward`` of the modeling file that
    defines its class, or a class it derives from (a user's subclass)."""
    for cls in type(module).__mro__:
        found = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if callable(found):
            return found
    return None


class _ModuleWith:
    """``module`` with some of its parameters read as other tensors: the leaves backward
    differentiates, for an eager function that reads them from the module (gpt-oss's
    ``module.sinks``)."""

    def __init__(self, module, replaced: dict[str, torch.Tensor]) -> None:
        self.__dict__.update(_module=module, _replaced=replaced)

    def __getattr__(self, name):
        replaced = self.__dict__["_replaced"]
        return replaced[name] if name in replaced else getattr(self.__dict__["_module"], name)


def _differentiable_extras(module, kwargs) -> tuple[list, list]:
    """The tensors besides q, k, v whose gradient the eager function gives: the module's own
    trained parameters (not its children's) and tensor arguments that require grad, each
    once, with where the function reads it: ``(tensors, [(index, "attribute" | "keyword",
    name)])``. gpt-oss passes its sinks both ways (``s_aux=self.sinks``; eager reads
    ``module.sinks``): one tensor, two bindings."""
    tensors: list[torch.Tensor] = []
    bindings: list[tuple[int, str, str]] = []

    def index_of(tensor):
        for i, known in enumerate(tensors):
            if known is tensor:
                return i
        tensors.append(tensor)
        return len(tensors) - 1

    for name, parameter in module.named_parameters(recurse=False):
        if parameter.requires_grad:
            bindings.append((index_of(parameter), "attribute", name))
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            bindings.append((index_of(value), "keyword", name))
    return tensors, bindings


def compressed_eager_recompute_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    """Drop-in for a decoder's own ``eager_attention_forward`` (found by
    :func:`eager_function_of`): the output and attention weights are that function's, computed
    by it; the saved state is compressed q, k, v, and backward re-runs the function on them (see
    :class:`RecomputedAttentionFunction`). For models that run eager attention: gpt-oss (its
    sinks take their gradient here), Gemma 2 (soft-capping), any registered decoder a user sets
    to eager. Stock eager keeps each layer's [S, S] probabilities (and more) for backward."""
    state = module.__dict__.get(STATE) if module is not None else None
    function = getattr(state, "attention_function", None) or eager_function_of(module)
    if function is None:
        raise RuntimeError(
            f"hf_actq: {type(module).__name__} calls the attention function its config names, "
            "but its modeling file has no eager_attention_forward to run; call "
            "hf_actq.apply(model, ActQConfig(..., attention=False)) to keep attention stock"
        )
    dropout = float(kwargs.get("dropout", 0.0) or 0.0)
    if (
        # A module of a model hf_actq did not patch (see compressed_sdpa_attention)
        state is None
        or kwargs.get("cache") is not None
        or (dropout > 0.0 and _dropout_stays_stock(query))
    ):
        return function(module, query, key, value, attention_mask, **kwargs)
    extras, bindings = _differentiable_extras(module, kwargs)
    # Backward calls this again: it holds the arguments that have no gradient as they came.
    bound = {name for _, kind, name in bindings if kind == "keyword"}
    options = {k: v for k, v in kwargs.items() if k not in bound}

    def run_eager(q, k, v, mask, *tensors):
        attributes = {n: tensors[i] for i, kind, n in bindings if kind == "attribute"}
        keywords = {n: tensors[i] for i, kind, n in bindings if kind == "keyword"}
        own = all(getattr(module, n) is t for n, t in attributes.items())
        target = module if own else _ModuleWith(module, attributes)
        output, weights = function(target, q, k, v, mask, **options, **keywords)
        return output, weights

    if not wants_backward(module, query, key, value, *extras):
        output, weights = run_eager(query, key, value, attention_mask, *extras)
        keep_rng_stream(module, *(state.codecs.get(name) for name in SDPA_SLOTS))
        return output, weights
    output, weights = RecomputedAttentionFunction.apply(
        query, key, value, attention_mask, run_eager, dropout, state, *extras
    )
    open_gate_window(state)
    return output, weights


def register_eager_recompute_attention(name: str = EAGER_RECOMPUTE_NAME) -> str:
    """Register :func:`compressed_eager_recompute_attention` with eager's mask builder under
    ``name``; returns it for ``config._attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, compressed_eager_recompute_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return name
