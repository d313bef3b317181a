"""Patching attention: the compressed attention functions are registered with transformers'
``AttentionInterface`` and the model's config is pointed at them; each attention module gets
its slot codecs and the implementation to fall back on where nothing is kept for backward."""

from __future__ import annotations

import functools
import weakref

from torch import nn

from hf_actq.codecs.packed import ExactCodec
from hf_actq.config import ActQConfig
from hf_actq.integrations.patching import bind_forward, left_to_foreign_forward
from hf_actq.integrations.slots import slot_codec
from hf_actq.ops.attention import (
    ATTENTION_NAME,
    EAGER_RECOMPUTE_NAME,
    EAGER_SLOTS,
    SDPA_NAME,
    SDPA_SLOTS,
    eager_function_of,
    register_attention,
    register_eager_recompute_attention,
    register_sdpa_attention,
)
from hf_actq.ops.deberta_attention import SLOTS as DEBERTA_SLOTS
from hf_actq.ops.deberta_attention import (
    CompressedDisentangledSelfAttention,
    is_disentangled_attention,
)
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.gated_output import SLOTS as GATED_SLOTS
from hf_actq.ops.gated_output import gated_attention_forward
from hf_actq.ops.rotary import NORMS, clamps_in_place, rotary_attention_forward
from hf_actq.ops.state import STATE, OpState, remove_state, set_state

# A config is shared by every model built from it (``from_config`` keeps the object): the
# implementation it had before the first patched model pointed it at ours, and how many
# patched models use it, by id(config). The last one's revert puts the original back.
_POINTED: dict[int, list] = {}


def _original_implementation(model_config) -> str | None:
    """The implementation ``model_config`` names, or, where another patched model already
    pointed it at ours, the one it named before."""
    pointed = _POINTED.get(id(model_config))
    return pointed[0] if pointed is not None else model_config._attn_implementation


def _point(model_config, name: str, original: str | None, handle) -> None:
    """Point ``model_config`` at ``name`` for this handle; ``original``: what the model ran
    before, for a config that names ours already without our record of it (a per-stack copy
    made from a config another patched model had pointed)."""
    pointed = _POINTED.get(id(model_config))
    if pointed is None:
        current = model_config._attn_implementation
        ours = (ATTENTION_NAME, SDPA_NAME, EAGER_RECOMPUTE_NAME)
        current = original if current in ours else current
        pointed = _POINTED[id(model_config)] = [current, 0]
        weakref.finalize(model_config, _POINTED.pop, id(model_config), None)
    pointed[1] += 1
    handle.record(undo=functools.partial(_release, model_config, pointed[0]))
    model_config._attn_implementation = name


def _release(model_config, original: str | None) -> None:
    pointed = _POINTED.get(id(model_config))
    if pointed is None:  # a deep copy's own config (the copy reverts on its own)
        model_config._attn_implementation = original
        return
    pointed[1] -= 1
    if pointed[1] <= 0:
        model_config._attn_implementation = pointed[0]
        del _POINTED[id(model_config)]


# Config attributes that hold the attention-probability dropout, by model family.
_ATTENTION_DROPOUT = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")


def patch_attention(
    model: nn.Module, config: ActQConfig, handle, layout, cache: PackCache | None = None
) -> None:
    """Compress attention in the ``layout.attention`` form ("eager": BERT's layout, as SDPA
    or, for models set to eager attention, with the probabilities; "sdpa": decoders; None
    leaves it exact)."""
    model_config = getattr(model, "config", None)
    if layout.attention is None or model_config is None:
        if layout.note:
            handle.skipped["attention"] = layout.note
        return
    codec = _attention_codec(config, layout)
    if not config.attention:
        if not (layout.attention == "eager" and config.dropout and _attention_dropout(model) > 0):
            return
        # Dropout compression covers attention-probability dropout too: eager attention (and
        # SDPA's math path, which CPUs take under dropout) keeps the dropped probabilities and
        # a byte-per-element mask besides the probabilities; the ops keep q, k, v exact and the
        # mask as a seed (eager, with the probabilities) or as the RNG state (SDPA).
        codec = None
    if layout.attention == "deberta":
        _patch_disentangled(model, config, handle, codec)
        return
    previous = _original_implementation(model_config)
    if previous not in ("eager", "sdpa", None) or (layout.attention == "sdpa" and not previous):
        handle.skipped["attention"] = f"{previous!r} attention (kept exact)"
        return
    # A model that runs SDPA keeps running it (backward recomputes it from compressed q, k, v:
    # no [S, S] tensor is kept); a decoder set to eager keeps running its own eager function,
    # recomputed in backward the same way; an encoder set to eager, the eager op that keeps the
    # probabilities (and their dropout mask as a seed).
    if layout.attention == "eager" and previous == "eager":
        kind = "eager"
    elif previous == "eager":
        kind = "eager, recomputed"
    else:
        kind = "sdpa"
        for attribute, reason in layout.exact_attention_when:
            if getattr(model_config, attribute, None):
                handle.skipped["attention"] = f"{reason} (kept exact)"
                return
    name = {
        "eager": register_attention,
        "eager, recomputed": register_eager_recompute_attention,
        "sdpa": register_sdpa_attention,
    }[kind]()
    slots = EAGER_SLOTS if kind == "eager" else SDPA_SLOTS
    # The configs the attention modules read their implementation from: the model's, and copies
    # of it where a model keeps one per stack (T5's encoder and decoder).
    configs = {id(model_config): model_config}
    count = 0
    for path, module in model.named_modules():
        if config.skips(path) or not _is_attention(module):
            continue
        if left_to_foreign_forward(module, path, handle):
            continue
        function = eager_function_of(module) if kind == "eager, recomputed" else None
        if kind == "eager, recomputed" and function is None:
            # Not a transformers attention (SigLIP's pooling head is torch's
            # MultiheadAttention): it never calls the function the config names.
            handle.skipped[path] = "no eager_attention_forward of its own (kept as it is)"
            continue
        # Without grad in eval, the original implementation runs, so outputs stay identical.
        state = OpState(
            path=path,
            attention_fallback=previous,
            key_layout=config.key_layout,
            attention_function=function,
        )
        if cache is not None:  # the model's: the gated product offers o_proj its input there
            state.cache = cache
        module_slots = slots
        if codec is not None and type(module).__name__ in layout.gated_output_classes:
            module_slots += GATED_SLOTS
            state.gated_output = True
            state.offer_output = config.share_norm_outputs  # the product, to o_proj
        for slot in module_slots:
            # Attention kept exact (no codec) takes no per-slot settings.
            state.codecs[slot] = (
                ExactCodec() if codec is None else slot_codec(config, state.slot_id(slot), codec)
            )
        describe = functools.partial(_describe, kind, state)
        # Bound to the forward that takes the norms' packs (and gates, where it does), else to
        # the one that gates, else the state alone.
        bound = _takes_norm_offers(module, layout, state, path, describe, handle, config)
        if not bound and state.gated_output:
            bound = bind_forward(module, gated_attention_forward, state, path, describe, handle)
        if not bound:
            handle.record(path, describe, undo=functools.partial(remove_state, module))
            set_state(module, state)
        handle.add_slots(state, dict.fromkeys(module_slots, "attention"))
        own_config = getattr(module, "config", None)
        if own_config is not None and hasattr(own_config, "_attn_implementation"):
            configs.setdefault(id(own_config), own_config)
        count += 1
    if not count:
        return
    for patched_config in configs.values():
        _point(patched_config, name, previous, handle)


def _attention_codec(config: ActQConfig, layout):
    """The codec of attention's slots: the config's, or uniform rounding at
    ``layout.attention_min_bits`` where the config's keeps fewer bits a value (averaged or
    sampled groups count their bits over the group; SmaQ, whose codes have no one width, as
    fewer), per-slot settings deciding over either."""
    codec = config.make_codec()
    least = layout.attention_min_bits
    bits = getattr(codec, "bits", 0) / getattr(codec, "group_size", 1)
    if least is None or isinstance(codec, ExactCodec) or bits >= least:
        return codec
    return config.codec_for_setting({"codec": "uniform", "bits": least})


def _takes_norm_offers(
    module, layout, state: OpState, path: str, describe, handle, config: ActQConfig
) -> bool:
    """Where the model rotates its q/k norms' outputs into q and k and both norms offer them
    (compressed, sharing their outputs), wrap the module's forward so that attention keeps the
    norms' packs (:mod:`hf_actq.ops.rotary`); False where it does not. A norm with no per-slot
    setting of its own packs with the codec of the slot it feeds, where that one differs (Gemma
    4's q and k at 8 bits): one pack at the slot's precision, not a pack of each."""
    if layout.qk_norm_rotary is None:
        return False
    if layout.qk_norm_rotary_classes and type(module).__name__ not in layout.qk_norm_rotary_classes:
        return False
    if clamps_in_place(module):
        return False
    norm_states = []
    for name in NORMS.values():
        norm = getattr(module, name, None)
        norm_states.append(None if norm is None else norm.__dict__.get(STATE))
        if norm_states[-1] is None or not norm_states[-1].offer_output:
            return False
    state.qk_norm_rotary = layout.qk_norm_rotary
    if not bind_forward(module, rotary_attention_forward, state, path, describe, handle):
        return False
    for slot, norm_state in zip(NORMS, norm_states):
        norm_state.record_offer = True
        codec = state.codecs[slot]
        if (
            not isinstance(codec, ExactCodec)
            and config.setting_for(norm_state.slot_id("input")) is None
        ):
            norm_state.codecs["input"] = codec
            handle.redescribe(norm_state.path)
    return True


def _patch_disentangled(model: nn.Module, config: ActQConfig, handle, codec) -> None:
    """DeBERTa-v2/v3's own attention modules (not through ``AttentionInterface``): their forward
    is bound to the op that keeps packed q, k, v and recomputes the core in backward."""
    for path, module in model.named_modules():
        if config.skips(path) or not is_disentangled_attention(module):
            continue
        state = OpState(path=path)
        for slot in DEBERTA_SLOTS:
            state.codecs[slot] = slot_codec(config, state.slot_id(slot), codec) or ExactCodec()
        describe = functools.partial(_describe, "disentangled, recomputed in backward", state)
        if bind_forward(
            module, CompressedDisentangledSelfAttention.forward, state, path, describe, handle
        ):
            handle.add_slots(state, dict.fromkeys(DEBERTA_SLOTS, "attention"))


def _describe(kind: str, state: OpState) -> str:
    gated = "; its output * sigmoid(gate) as the output's and the gate's packs"
    gated = gated if state.gated_output else ""
    if state.codecs and all(isinstance(c, ExactCodec) for c in state.codecs.values()):
        mask = "a seed" if kind == "eager" else "its RNG state"
        return f"attention ({kind}) exact operands, dropout mask as {mask}{gated}"
    codecs = set(map(repr, state.codecs.values()))
    shown = (
        codecs.pop()
        if len(codecs) == 1
        else ", ".join(f"{s}={c!r}" for s, c in state.codecs.items())
    )
    if state.qk_norm_rotary is not None:
        shown += "; q, k as the q/k norms' packs, rotated again in backward, where they fit"
    return f"attention ({kind}) {shown}{gated}"


def _attention_dropout(model) -> float:
    model_config = getattr(model, "config", None)
    return max(
        (float(getattr(model_config, n, 0.0) or 0.0) for n in _ATTENTION_DROPOUT), default=0.0
    )


def _is_attention(module) -> bool:
    # The innermost *Attention module calls the attention function; BERT's BertAttention only
    # wraps BertSelfAttention and its output projection.
    def named_attention(m):
        return type(m).__name__.endswith("Attention")

    return named_attention(module) and not any(
        named_attention(child) for child in module.modules() if child is not module
    )
