"""Compress an input once when several ops consume it (q/k/v, gate/up, LoRA A and its base).

An entry is found by the input's identity (a weak reference, since freed storage is reused and
``data_ptr`` alone would match a different tensor) and its version counter (an in-place update
must not return stale codes). The cache holds nothing strongly: an entry is reused only while
the input and the packed buffers are still alive, which they are exactly when an earlier
consumer's autograd node keeps them. So the cache never keeps a buffer that backward would not
keep anyway: under non-reentrant checkpointing, where no node keeps them in the first pass, each
consumer packs its own copy and frees it at once, as checkpointing intends.

No lock: dictionary reads and writes are atomic under the GIL, the worst race packs a tensor
twice, and there are no weak-reference callbacks that could run (and block) inside a locked
section during a garbage collection.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import Codec, Packed, draw_seed, draw_seed_tensor
from hf_actq.ops.slots import observer, seed_override


@dataclass(frozen=True)
class _Entry:
    source: weakref.ref
    version: int
    header: Packed  # the packed object without its tensors
    buffers: tuple[weakref.ref, ...]
    slot: str | None  # the slot that packed it
    offered: bool = False  # a form rebuilt from another op's buffers (PackCache.offer)

    def reuse(self, x: torch.Tensor, codec: Codec) -> Packed | None:
        if self.source() is not x or self.version != x._version or self.header.codec != codec:
            return None
        tensors = tuple(ref() for ref in self.buffers)
        if any(t is None for t in tensors):
            return None
        return self.header.with_tensors(tensors)

    @property
    def alive(self) -> bool:
        return self.source() is not None and all(ref() is not None for ref in self.buffers)


class PackCache:
    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._purge_at = 64

    def pack(self, x: torch.Tensor, codec: Codec, slot: str | None = None) -> Packed:
        """``codec.pack(x)`` for ``slot``, reusing the result of an earlier call on the same live
        tensor.

        A stochastic codec's seed is drawn whether or not the result is reused, so the RNG stream
        (and with it checkpoint replay) does not depend on what the cache holds.
        """
        if torch.compiler.is_compiling():
            return traced_pack(x, codec)
        seed = None
        if codec.uses_rng:
            seed = seed_override(slot)
            seed = draw_seed() if seed is None else seed
        watcher = observer()
        if x.is_inference():  # no version counter to key on
            return self._packed(watcher, slot, x, codec, seed)
        key = id(x)
        entry = self._entries.get(key)
        # Offered forms depend on another op's buffers being alive, which differs between a
        # checkpointed region's first pass and its recomputation: not taken there.
        if entry is not None and entry.offered and under_checkpoint():
            entry = None
        found = entry.reuse(x, codec) if entry is not None else None
        if found is not None:
            if watcher is not None:
                watcher.on_pack(slot, x, codec, found.nbytes, entry.slot)
            return found
        packed = self._packed(watcher, slot, x, codec, seed)
        self._entries[key] = _Entry(
            weakref.ref(x),
            x._version,
            packed.with_tensors(()),
            tuple(weakref.ref(t) for t in packed.tensors),
            slot,
        )
        if len(self._entries) >= self._purge_at:
            self._purge()
        return packed

    def offer(self, x: torch.Tensor, packed: Packed, slot: str | None = None) -> None:
        """Let later ``pack(x, codec)`` calls with ``packed``'s codec return ``packed``, a form
        of ``x`` rebuilt from buffers an op keeps anyway (a norm's packed input rebuilds its
        output), while ``x`` and those buffers are alive."""
        if x.is_inference():
            return
        self._entries[id(x)] = _Entry(
            weakref.ref(x),
            x._version,
            packed.with_tensors(()),
            tuple(weakref.ref(t) for t in packed.tensors),
            slot,
            offered=True,
        )

    @staticmethod
    def _packed(watcher, slot, x, codec, seed) -> Packed:
        packed = codec.pack(x, seed)
        if watcher is not None:
            watcher.on_pack(slot, x, codec, packed.nbytes, None)
        return packed

    def _purge(self) -> None:
        for key, entry in list(self._entries.items()):
            if not entry.alive and self._entries.get(key) is entry:
                del self._entries[key]
        self._purge_at = max(64, 2 * len(self._entries))

    def __len__(self) -> int:
        """Entries that could still be reused."""
        self._purge()
        return len(self._entries)


DEFAULT_CACHE = PackCache()


def under_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are non-reentrant activation checkpointing's."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


def traced_pack(x: torch.Tensor, codec: Codec) -> Packed:
    """:meth:`PackCache.pack` in a torch.compile trace: one traced op (``hf_actq::pack``) per
    consumer, with no reuse. Each autograd Function is traced as a subgraph of its own, which
    cannot use a tensor another one made, so consumers of a shared input (q/k/v, gate/up) each
    keep a copy, and stochastic ones round with seeds of their own."""
    from hf_actq.codecs.library import compiled_pack

    seed = draw_seed_tensor() if codec.uses_rng else None
    return codec.pack(x) if codec.name == "exact" else compiled_pack(x, codec, seed)
