"""Compress an input once when several ops consume it (q/k/v, gate/up, LoRA A and its base).

Entries are keyed by tensor identity with a weak reference and the tensor's version counter:
``data_ptr`` alone is not enough, because freed storage is reused by the next allocation, and an
in-place update of the same tensor must not return stale codes.
"""

from __future__ import annotations

import threading
import weakref

import torch

from hf_actq.codecs.packed import Codec, Packed, draw_seed


class PackCache:
    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, Codec, Packed]] = {}
        self._lock = threading.Lock()

    def pack(self, x: torch.Tensor, codec: Codec) -> Packed:
        """``codec.pack(x)``, reusing the result of an earlier call on the same live tensor.

        A stochastic codec's seed is drawn whether or not the result is reused, so the RNG stream
        (and with it checkpoint replay) does not depend on what the cache holds.
        """
        seed = draw_seed() if codec.uses_rng else None
        key = id(x)
        with self._lock:
            entry = self._entries.get(key)
            if (
                entry is not None
                and entry[0]() is x
                and entry[1] == x._version
                and entry[2] == codec
            ):
                return entry[3]
        packed = codec.pack(x, seed)
        with self._lock:
            self._entries[key] = (weakref.ref(x, self._forget(key)), x._version, codec, packed)
        return packed

    def _forget(self, key):
        def callback(ref):
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] is ref:
                    del self._entries[key]

        return callback

    def __len__(self) -> int:
        return len(self._entries)


DEFAULT_CACHE = PackCache()
