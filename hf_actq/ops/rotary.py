"""Attention's q and k rebuilt from their q/k norms' packs, through RoPE.

Qwen3 (dense and MoE), Gemma 3, OLMo-2/3 and OLMoE normalize q and k (per head, or over all heads)
and then rotate them (RoPE) before attention. A compressed norm keeps its input packed and
offers its output, rebuilt from that pack, to the ops that consume it
(:class:`hf_actq.ops.norm.NormOutputPacked`); but attention consumes the *rotated* output, so it
packed q and k a second time: at Qwen3-30B-A3B's shapes under "uniform" 4 bits, 4.5 MiB a
layer on top of the norms' own. Here attention takes the norms' offered forms instead and
rotates them again when backward unpacks them, with the stock formula and the position
embeddings the forward used (which RoPE's own backward keeps anyway): no bytes of its own.
Its error is the rotation of the norm output's (RoPE is orthogonal), where the second pack
added its own.

How a norm's output becomes attention's operand before the rotation is per model, as data in
the registry (``ModelLayout.qk_norm_rotary``), each checked bit for bit against the model by
the tests:

- ``"heads"``: the norm runs on ``[batch, seq, heads, dim]`` and attention takes its transpose
  (Qwen3, Qwen3-MoE);
- ``"flat"``: the norm runs over all heads, ``[batch, seq, heads * dim]`` (OLMo-2, OLMo-3,
  OLMoE without ``clip_qkv``, which clamps the norms' outputs in place);
- ``"attention"``: the norm runs on attention's own ``[batch, heads, seq, dim]`` (Gemma 3).

The attention module's forward is wrapped (on the instance) to hold the call's position
embeddings and to take only what its own norms offered during that call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import Codec, Packed
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.gated_output import run_gated
from hf_actq.ops.state import STATE, OpState, has_hooks, state_of

LAYOUTS = ("heads", "flat", "attention")
# The norms whose outputs attention's q and k slots take, by slot.
NORMS = {"q": "q_norm", "k": "k_norm"}


@dataclass(frozen=True)
class RotaryPacked(Packed):
    """Attention's q or k (``shape``: ``[batch, heads, seq, dim]``) as RoPE of its norm's
    offered form: ``tensors`` are that form's, then the call's cos and sin (``[batch or 1, seq,
    dim]``, or narrower under partial RoPE: the tensors stock RoPE's backward keeps)."""

    source: Packed | None = None  # the norm's offered form, without its tensors
    layout: str = "heads"

    @property
    def nbytes(self) -> int:
        return self.source.with_tensors(self.tensors[:-2]).nbytes

    def _unpack(self) -> torch.Tensor:
        value = self.source.with_tensors(self.tensors[:-2]).unpack()
        cos, sin = (t.unsqueeze(1) for t in self.tensors[-2:])
        batch, heads, seq, dim = self.shape
        if self.layout == "flat":
            value = value.view(batch, seq, heads, dim)
        if self.layout != "attention":
            value = value.transpose(1, 2)
        # transformers' apply_rotary_pos_emb, operation for operation; where cos and sin are
        # narrower than a head (partial RoPE: Qwen3.5 rotates a quarter), the rest passes.
        width = cos.shape[-1]
        rotating = value[..., :width] if width < dim else value
        half = width // 2
        rotated = torch.cat((-rotating[..., half:], rotating[..., :half]), dim=-1)
        embedded = (rotating * cos) + (rotated * sin)
        if width < dim:
            embedded = torch.cat([embedded, value[..., width:]], dim=-1)
        return embedded.to(self.dtype)


def _norm_shape(layout: str, shape: torch.Size) -> tuple[int, ...]:
    """The norm output's shape that ``layout`` makes attention's ``shape`` from."""
    batch, heads, seq, dim = shape
    return {
        "heads": (batch, seq, heads, dim),
        "flat": (batch, seq, heads * dim),
        "attention": (batch, heads, seq, dim),
    }[layout]


def rotated_pack(state: OpState, x: torch.Tensor, slot: str, codec: Codec) -> Packed | None:
    """``x`` (attention's ``slot``, "q" or "k") as :class:`RotaryPacked` of what its norm
    offered in this call, where the attention module's wrapped forward runs and the offer fits
    (``codec``, the shapes, the position embeddings); None otherwise, and the caller packs ``x``
    itself."""
    call = state.rotary
    if call is None or slot not in NORMS or x.dim() != 4:
        return None
    cos, sin, norm_states = call
    # None under non-reentrant checkpointing too: the norms offer nothing there (dedup.may_offer).
    entry = getattr(norm_states.get(slot), "offered", None)
    if entry is None:
        return None
    layout = state.qk_norm_rotary
    dim = x.shape[-1]
    if (
        tuple(entry.header.shape) != _norm_shape(layout, x.shape)
        or cos.shape != sin.shape
        or cos.dim() != 3
        or cos.shape[0] not in (1, x.shape[0])
        or cos.shape[1] != x.shape[2]
        or cos.shape[2] % 2
        or cos.shape[2] > dim
    ):
        return None
    found = PackCache.take_offered(entry, x, codec, state.slot_id(slot))
    if found is None:
        return None
    return RotaryPacked(
        codec, x.shape, x.dtype, (*found.tensors, cos, sin), found.with_tensors(()), layout
    )


def clamps_in_place(attention) -> bool:
    """Whether the model clamps the norms' outputs in place before RoPE (OLMoE's
    ``clip_qkv``): their offers would be of the unclamped values."""
    return getattr(getattr(attention, "config", None), "clip_qkv", None) is not None


def _position_embeddings(args, kwargs):
    """The ``(cos, sin)`` an attention module's forward was called with, or None."""
    found = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    if isinstance(found, tuple) and len(found) == 2 and all(type(t) is torch.Tensor for t in found):
        return found
    return None


def rotary_attention_forward(self, *args, **kwargs):
    """The attention module's own forward, with its position embeddings and its q/k norms'
    offers of this call at hand for :func:`rotated_pack` (and its gated output kept packed,
    where it has one: :mod:`hf_actq.ops.gated_output`)."""
    state = state_of(self)
    return run_gated(state, _rotary_call, self, state, args, kwargs)


def _rotary_call(self, state: OpState, args, kwargs):
    embeddings = _position_embeddings(args, kwargs)
    if (
        embeddings is None
        or torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        # A forward hook may give RoPE another tensor than the one the norm offered.
        or any(has_hooks(getattr(self, name)) for name in NORMS.values())
        or torch.nn.modules.module._global_forward_hooks
        or clamps_in_place(self)  # set after apply
    ):
        return state.plain(*args, **kwargs)
    norm_states = {slot: getattr(self, name).__dict__.get(STATE) for slot, name in NORMS.items()}
    for norm_state in norm_states.values():
        if norm_state is not None:
            norm_state.offered = None  # only what the norms offer in this call counts
    state.rotary = (*embeddings, norm_states)
    try:
        return state.plain(*args, **kwargs)
    finally:
        state.rotary = None
        for norm_state in norm_states.values():
            if norm_state is not None:
                norm_state.offered = None
