"""Slots: the named tensors compressed ops keep for backward.

Every tensor an op compresses has a stable id, ``"<module path>:<slot name>"`` (for example
``model.layers.3.mlp:up`` or ``model.layers.3.self_attn:k``), which plans, logs and reports use.
Slot names per op: ``input`` (linear layers and norms: the packed input), ``act`` (the few-bit
code of an activation's derivative), ``gate`` and ``up`` (a gated MLP's operands, besides its
``input`` and ``act``), ``gate_up`` (MoE experts whose gate is recomputed: the projection's
output), ``q``, ``k``, ``v`` and ``probs`` (attention).

Two context-local hooks let the adaptive pass see and steer slots without touching the ops'
arithmetic: an observer told about every slot a forward fills (to list slots and measure their
codecs on the real tensors), and per-slot seeds for stochastic rounding (GradNormVar changes one
slot's seed and nothing else).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch

# Slot kinds, for reports and per-kind summaries.
KINDS = ("linear", "norm", "activation", "mlp", "attention")


class SlotObserver:
    """Told about each slot a forward fills; subclass and pass to :func:`observe`."""

    # A passive observer (the training monitor's) must not change what the ops keep; the
    # adaptive pass's is not passive: the ops then keep each slot's own pack, unshared.
    passive = False

    def on_pack(self, slot: str, x: torch.Tensor, codec, nbytes: int, shared_with: str | None):
        """A codec slot: ``x`` packed with ``codec`` into ``nbytes`` bytes, or (``shared_with``
        set) found already packed by that slot."""

    def on_fewbit(self, slot: str, x: torch.Tensor, activation) -> None:
        """A few-bit slot: the input ``x`` of ``activation`` (an ActivationTable)."""


_OBSERVER: ContextVar[SlotObserver | None] = ContextVar("hf_actq_slot_observer", default=None)
_SEEDS: ContextVar[Callable[[str], int] | None] = ContextVar("hf_actq_slot_seeds", default=None)


@contextmanager
def observe(observer: SlotObserver) -> Iterator[SlotObserver]:
    token = _OBSERVER.set(observer)
    try:
        with _eager():
            yield observer
    finally:
        _OBSERVER.reset(token)


@contextmanager
def slot_seeds(seed_for: Callable[[str], int]) -> Iterator[None]:
    """Stochastic rounding takes ``seed_for(slot id)`` instead of a draw from torch's RNG."""
    token = _SEEDS.set(seed_for)
    try:
        with _eager():
            yield
    finally:
        _SEEDS.reset(token)


def _eager():
    """Compiled modules run eagerly inside: hooks are read while a forward runs, which a
    compiled graph cannot do (and these passes are measurements, not training steps)."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return nullcontext() if set_stance is None else set_stance("force_eager")


# Under torch.compile no hook is active (the context managers above force eager execution),
# and dynamo cannot trace ContextVar.get: the traced forward takes the plain path.
def observer() -> SlotObserver | None:
    return None if torch.compiler.is_compiling() else _OBSERVER.get()


def per_slot_seeds() -> bool:
    return not torch.compiler.is_compiling() and _SEEDS.get() is not None


def seed_override(slot: str | None) -> int | None:
    seed_for = None if torch.compiler.is_compiling() else _SEEDS.get()
    return None if seed_for is None or slot is None else seed_for(slot)
