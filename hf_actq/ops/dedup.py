"""Compress an input once when several ops consume it (q/k/v, gate/up, LoRA A and its base).

An entry is found by where the input's data lies (storage, offset, shape, strides, dtype) while
that storage is alive (a weak reference to it: freed storage is reused, and ``data_ptr`` alone
would match a different tensor), and by the version counter (an in-place update must not return
stale codes). So an alias of the input counts as the input: DeepSpeed ZeRO-3 hands every module
its own ``detach()`` of each input (to hook its backward), which lives only as long as that
module's call, and q, k and v, or gate and up, would otherwise each pack their copy. The cache holds nothing strongly: an entry is reused only while
the input and the packed buffers are still alive, which they are exactly when an earlier
consumer's autograd node keeps them. So the cache never keeps a buffer that backward would not
keep anyway: under non-reentrant checkpointing, where no node keeps them in the first pass, each
consumer packs its own copy and frees it at once, as checkpointing intends.

No lock: dictionary reads and writes are atomic under the GIL, the worst race packs a tensor
twice, and there are no weak-reference callbacks that could run (and block) inside a locked
section during a garbage collection.
"""

from __future__ import annotations

import copy
import re
import warnings
import weakref
import zlib
from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import (
    _RANK_STRIDE,
    _SEED_MODULUS,
    Codec,
    Packed,
    UnpackShare,
    capturing_cuda_graph,
    draw_seed,
    draw_seed_tensor,
    process_rank,
)
from hf_actq.kernels import seeded_dropout
from hf_actq.ops.slots import observer, per_slot_seeds, seed_override


@dataclass(frozen=True)
class _Entry:
    storage: weakref.ref  # of the packed input's storage (see _anchor)
    version: int
    header: Packed  # the packed object without its tensors
    buffers: tuple[weakref.ref, ...]
    slot: str | None  # the slot that packed it
    offered: bool = False  # a form rebuilt from another op's buffers (PackCache.offer)

    def reuse(self, x: torch.Tensor, codec: Codec) -> Packed | None:
        # Found by where x's data lies, in a storage still alive (so not freed and reused):
        # x is the packed tensor or an alias of it, unchanged since it was packed if the version
        # counter (which detach() and views share) is where it was.
        if self.storage() is None or self.version != x._version or self.header.codec != codec:
            return None
        return self.rebuild(codec)

    def rebuild(self, codec: Codec) -> Packed | None:
        """The packed form with its buffers, if ``codec`` is its codec and they are alive."""
        if self.header.codec != codec:
            return None
        tensors = tuple(ref() for ref in self.buffers)
        if any(t is None for t in tensors):
            return None
        return self.header.with_tensors(tensors)

    @property
    def alive(self) -> bool:
        return self.storage() is not None and all(ref() is not None for ref in self.buffers)


def _where(x: torch.Tensor) -> tuple:
    """Where ``x``'s data lies, which its aliases share (a key of :class:`PackCache`); the
    tensor's identity where that says nothing (no data, or no storage of its own)."""
    if x.numel() == 0 or x.device.type == "meta" or type(x) is not torch.Tensor:
        return (id(x),)
    pointer = x.untyped_storage().data_ptr()
    return (pointer, x.storage_offset(), x.shape, x.stride(), x.dtype, x.device)


def _reshaped_from(x: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``x`` is a reshaped view of (the same contiguous data, all of it), or None."""
    base = x._base
    if (
        base is None
        or base.dtype != x.dtype
        or base.numel() != x.numel()
        or base.data_ptr() != x.data_ptr()
        or not (x.is_contiguous() and base.is_contiguous())
    ):
        return None
    return base


def _anchor(x: torch.Tensor, key: tuple) -> weakref.ref:
    """A weak reference alive exactly while the data ``key = _where(x)`` names is: to the
    storage (torch keeps one Python object per live storage), or to ``x`` where the key is its
    identity."""
    return weakref.ref(x) if len(key) == 1 else weakref.ref(x.untyped_storage())


@dataclass(frozen=True)
class _Alias:
    """A tensor made from another one by a step whose result need not be packed on its own: a
    dtype cast, or a seeded dropout (``seed`` is the dropout's saved seed tensor)."""

    storage: weakref.ref  # of the derived tensor's storage (see _anchor)
    version: int
    source: weakref.ref  # the tensor it was made from
    source_version: int
    p: float = 0.0  # dropout probability; 0: a cast
    seed: torch.Tensor | None = None
    # The form its source's op offered, when it had one (a gated product's): found through the
    # alias even after the source itself is freed (T5 drops its product out and keeps only the
    # dropout's output), while the offerer's buffers live.
    offered: _Entry | None = None

    def resolve(self, x: torch.Tensor) -> torch.Tensor | None:
        source = self.source()
        if self.storage() is None or self.version != x._version or source is None:
            return None
        return source if source._version == self.source_version else None


@dataclass(frozen=True)
class DerivedPacked(Packed):
    """A tensor rebuilt from its source's packed form: cast to its dtype, with a seeded dropout
    the very mask it was made with, and in its shape (a reshaped view). ``tensors`` are the
    source's buffers, then the dropout's seed tensor (the one the dropout itself keeps: no
    bytes of its own)."""

    source: Packed | None = None  # without its tensors
    p: float = 0.0

    @property
    def _split(self) -> int:
        return len(self.tensors) - (self.p > 0)

    def _unpack(self) -> torch.Tensor:
        value = self.source.with_tensors(self.tensors[: self._split]).unpack().to(self.dtype)
        if self.p > 0:
            value = seeded_dropout(value, self.p, int(self.tensors[-1].item()))
        return value if value.shape == self.shape else value.reshape(self.shape)


class PackCache:
    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._aliases: dict[tuple, _Alias] = {}
        self._purge_at = 64

    def alias(
        self,
        derived: torch.Tensor,
        source: torch.Tensor,
        p: float = 0.0,
        seed: torch.Tensor | None = None,
    ) -> None:
        """Let ``pack(derived)`` pack ``source`` instead, while both are alive and unchanged:
        ``derived`` is ``source`` cast to another dtype (PEFT's fp32 adapters on a bf16 model
        cast the input once per adapter), or with ``p`` the seeded dropout of it whose seed is
        ``seed``. The consumers of one input (q/k/v's, gate/up's LoRA A) then share one pack of
        it in its own dtype, or the norm's offered output, instead of each packing its copy."""
        if derived.is_inference() or source.is_inference():
            return
        key = _where(derived)
        offered = self._entries.get(_where(source))
        if offered is not None and not (offered.offered and offered.version == source._version):
            offered = None
        self._aliases[key] = _Alias(
            _anchor(derived, key),
            derived._version,
            weakref.ref(source),
            source._version,
            p,
            seed,
            offered,
        )
        if len(self._aliases) >= self._purge_at:
            self._purge()

    def _resolved(self, x: torch.Tensor) -> tuple[torch.Tensor, _Alias | None]:
        """The tensor ``x`` was derived from, through casts and at most one dropout (PEFT: a
        cast, then the adapter's dropout), and that dropout."""
        dropout = None
        for _ in range(4):
            found = self._aliases.get(_where(x))
            source = found.resolve(x) if found is not None else None
            if source is None or (found.p > 0 and dropout is not None):
                break
            dropout = found if found.p > 0 else dropout
            x = source
        return x, dropout

    def pack(
        self, x: torch.Tensor, codec: Codec, slot: str | None = None, linear_input: bool = False
    ) -> Packed:
        """``codec.pack(x)`` for ``slot``, reusing the result of an earlier call on the same live
        tensor. ``linear_input``: ``x`` is a linear layer's input (see :func:`traced_pack`).

        A stochastic codec's seed is drawn whether or not the result is reused, so the RNG stream
        (and with it checkpoint replay) does not depend on what the cache holds.
        """
        if torch.compiler.is_compiling():
            if slot is not None and linear_input:
                slot = sharing_group(slot)
            return traced_pack(x, codec, slot)
        if self._aliases and not x.is_inference():
            source, dropout = self._resolved(x)
            if source is not x:
                packed = self.pack(source, codec, slot, linear_input)
                return self._derived(packed, x, dropout)
        base = _reshaped_from(x)
        if base is not None and self.holds(base):
            # A reshape of a tensor already packed or offered (a MoE block flattens the norm's
            # output to [tokens, hidden] for its router and experts): its form, reshaped.
            return self._derived(self.pack(base, codec, slot, linear_input), x, None)
        seed = self.seed_for(codec, slot, x.device)
        watcher = observer()
        if self._aliases and not x.is_inference():
            alias = self._aliases.get(_where(x))
            if alias is not None and alias.offered is not None and alias.storage() is not None:
                found = alias.offered.rebuild(codec) if alias.version == x._version else None
                if found is not None and not under_checkpoint():
                    self._count_consumer(found, alias.offered)
                    if watcher is not None:
                        watcher.on_pack(slot, x, codec, found.nbytes, alias.offered.slot)
                    return self._derived(found, x, alias if alias.p > 0 else None)
        if x.is_inference():  # no version counter to key on
            return self._packed(watcher, slot, x, codec, seed)
        key = _where(x)
        entry = self._entries.get(key)
        # Offered forms depend on another op's buffers being alive, which differs between a
        # checkpointed region's first pass and its recomputation: not taken there.
        if entry is not None and entry.offered and under_checkpoint():
            entry = None
        found = entry.reuse(x, codec) if entry is not None else None
        if found is not None:
            self._count_consumer(found, entry)
            if watcher is not None:
                watcher.on_pack(slot, x, codec, found.nbytes, entry.slot)
            return found
        packed = self._packed(watcher, slot, x, codec, seed)
        self.remember(x, packed, slot, key)
        return packed

    @staticmethod
    def seed_for(
        codec: Codec, slot: str | None, device: torch.device | None = None
    ) -> int | torch.Tensor | None:
        """The seed :meth:`pack` draws for ``slot`` (one per stochastic pack, found or not); a
        pack on ``device`` captured into a CUDA graph takes :func:`captured_seed`."""
        if not codec.uses_rng:
            return None
        seed = seed_override(slot)
        if seed is None and capturing_cuda_graph(device):
            return captured_seed(codec, device)
        return draw_seed() if seed is None else seed

    def holds(self, x: torch.Tensor) -> bool:
        """Whether :meth:`pack` might find ``x`` (or what it was derived from) packed already:
        an entry or an alias for its data that is alive and unchanged since. (An entry left by
        a freed tensor whose memory ``x`` now reuses is not one: its storage is gone.)"""
        key = _where(x)
        for found in (self._entries.get(key), self._aliases.get(key)):
            if found is not None and found.storage() is not None and found.version == x._version:
                return True
        return False

    def remember(
        self, x: torch.Tensor, packed: Packed, slot: str | None, key: tuple | None = None
    ) -> None:
        """``packed``, just made from ``x`` (by :meth:`pack` or a fused kernel), for later
        packs of ``x`` to find, and as a pack one op keeps so far (``key``: ``_where(x)``, where
        the caller has it)."""
        object.__setattr__(packed, "_share", UnpackShare(consumers=1))
        key = _where(x) if key is None else key
        self._entries[key] = _Entry(
            _anchor(x, key),
            x._version,
            packed.with_tensors(()),
            tuple(weakref.ref(t) for t in packed.tensors),
            slot,
        )
        if len(self._entries) >= self._purge_at:
            self._purge()

    def offer(self, x: torch.Tensor, packed: Packed, slot: str | None = None) -> _Entry | None:
        """Let later ``pack(x, codec)`` calls with ``packed``'s codec return ``packed``, a form
        of ``x`` rebuilt from buffers an op keeps anyway (a norm's packed input rebuilds its
        output), while ``x`` and those buffers are alive. Returns the entry, which
        :meth:`take_offered` takes from where the consumer does not see ``x`` itself."""
        if x.is_inference():
            return None
        key = _where(x)
        header = packed.with_tensors(())
        object.__setattr__(header, "_share", UnpackShare())  # its consumers count themselves
        entry = self._entries[key] = _Entry(
            _anchor(x, key),
            x._version,
            header,
            tuple(weakref.ref(t) for t in packed.tensors),
            slot,
            offered=True,
        )
        return entry

    @classmethod
    def take_offered(
        cls, entry: _Entry, x: torch.Tensor, codec: Codec, slot: str | None
    ) -> Packed | None:
        """The form ``entry`` offered, for a consumer that keeps it in place of packing ``x``
        (made from the offered tensor: attention's rotated q and k, :mod:`hf_actq.ops.rotary`)
        with ``codec`` into ``slot``; None where its buffers are gone or its codec is another.
        Draws the seed the pack would have drawn."""
        found = entry.rebuild(codec)
        if found is None:
            return None
        cls.seed_for(codec, slot, x.device)
        cls._count_consumer(found, entry)
        watcher = observer()
        if watcher is not None:
            watcher.on_pack(slot, x, codec, found.nbytes, entry.slot)
        return found

    @staticmethod
    def _count_consumer(found: Packed, entry: _Entry) -> None:
        """One more op keeps ``found``: it is unpacked once for all of them."""
        found._share.consumers += 1
        # A form rebuilt from its offerer's own packs (a norm's output from its x_hat, a gated
        # product from its operands) is one more consumer of each, once taken: it unpacks them
        # once for all its takers.
        if entry.offered and found._share.consumers == 1:
            for source in found.sources:
                if source._share is not None:
                    source._share.consumers += 1

    @staticmethod
    def _derived(packed: Packed, x: torch.Tensor, dropout: _Alias | None) -> Packed:
        """``x`` rebuilt from ``packed`` (its source's form), through ``dropout`` if any."""
        p, extra = (dropout.p, (dropout.seed,)) if dropout is not None else (0.0, ())
        return DerivedPacked(
            packed.codec, x.shape, x.dtype, (*packed.tensors, *extra), packed.with_tensors(()), p
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
        for key, alias in list(self._aliases.items()):
            if (alias.storage() is None or alias.source() is None) and (
                self._aliases.get(key) is alias
            ):
                del self._aliases[key]
        self._purge_at = max(64, 2 * max(len(self._entries), len(self._aliases)))

    def __len__(self) -> int:
        """Entries that could still be reused."""
        self._purge()
        return len(self._entries)


DEFAULT_CACHE = PackCache()


def may_offer(state) -> bool:
    """Whether an op offers a form of its output rebuilt from buffers it keeps anyway (a norm's
    output from its packed x_hat, a gated product from its packed operands; ``state.
    offer_output``). Not while the adaptive pass observes slots or draws per-slot seeds (it must
    see each slot's own bytes and noise), in a torch.compile trace (no cache there), or under
    non-reentrant checkpointing: its first pass keeps no buffer alive and its recomputation
    does, so consumers would save a different set of tensors in the two passes, which
    checkpointing rejects."""
    return (
        state.offer_output
        and getattr(observer(), "passive", True)
        and not per_slot_seeds()
        and not torch.compiler.is_compiling()
        and not under_checkpoint()
    )


def under_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are non-reentrant activation checkpointing's."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


# The step seed that torch.compile traces mix per sharing group (see :func:`traced_pack`): one
# persistent int64 tensor on the patched model's device, advanced in place when the model
# embeds its input. Persistent rather than drawn per forward: a tensor a trace made and left in
# Python state is a side effect dynamo cannot replay at a graph break inside the forward
# (transformers' logging), and each such break would then become two. On the model's device,
# so that a CUDA graph of the step (torch.compile's "reduce-overhead") advances it on each
# replay and its packs read fresh seeds there: a seed read on the host is frozen at capture.
_STEP_SEED: list[torch.Tensor] = []
_ADVANCING_MODELS: weakref.WeakSet = weakref.WeakSet()


def step_seed() -> torch.Tensor:
    if not _STEP_SEED:
        _STEP_SEED.append(torch.zeros(1, dtype=torch.int64))
    return _STEP_SEED[0]


def _step_seed_on(device: torch.device | None) -> torch.Tensor:
    """The step seed, moved to ``device`` where the model runs elsewhere (it was moved after
    ``apply``). Only outside a trace: a trace moving it would leave a tensor it made in Python
    state; there, a pack reading a seed on another device copies it (traced_pack)."""
    seed = step_seed()
    if (
        device is not None
        and device.type != "meta"
        and seed.device != device
        and not torch.compiler.is_compiling()
    ):
        seed = _STEP_SEED[0] = seed.to(device)
    return seed


def _device_of(module: torch.nn.Module) -> torch.device | None:
    parameter = next(module.parameters(), None)
    return None if parameter is None else parameter.device


def advance_step_seed(module: torch.nn.Module | None = None, *hook_arguments) -> None:
    """A new step seed, once per forward of a patched model (also its forward pre-hook)."""
    device = None if module is None else _device_of(module)
    with torch.no_grad():
        _step_seed_on(device).add_(1)


def captured_seed(codec: Codec, device: torch.device) -> int | torch.Tensor:
    """The seed of a pack captured into a CUDA graph in eager mode (``torch.cuda.graph``,
    ``make_graphed_callables``): drawn on the device from its generator, which each replay
    advances, where the codec's kernels read it there (uniform, AQ, SmaQ, the rotated codec
    keeping every coefficient), so every replay rounds with fresh noise. A seed drawn on the
    host would be frozen into the graph: the sampled rotated codec's signs take one all the
    same, and a warning says so, once."""
    if codec.takes_device_seed:
        return draw_seed_tensor(device)
    _warn_frozen_noise(codec)
    return draw_seed()


_WARNED_FROZEN_NOISE: list[bool] = []


def _warn_frozen_noise(codec: Codec) -> None:
    if not _WARNED_FROZEN_NOISE:
        _WARNED_FROZEN_NOISE.append(True)
        warnings.warn(
            f"hf_actq: a {codec!r} pack is being captured into a CUDA graph in eager mode; "
            "its seed is drawn on the host, so every replay rounds it with the noise drawn at "
            "capture. Codecs that read their seeds on the GPU (uniform, alam, SmaQ, rotated "
            "with group_size=1) round with fresh noise on every replay.",
            stacklevel=4,
        )


INNER_FORWARD = "_hf_actq_embedding_forward"


def step_seed_forward(self, *args, **kwargs):
    """The forward ``apply`` binds onto a model's input embedding: advance, then embed. Also
    in eager, since layers compiled one by one read the seed while the model runs eagerly."""
    advance_step_seed(self)
    return self.__dict__[INNER_FORWARD](*args, **kwargs)


def start_step_seed(model: torch.nn.Module) -> _Advancing:
    """Mark ``model``'s packs as advanced per forward; returns the undo."""
    # Started from torch's seed (salted with the rank, as every seed) without drawing from
    # its generator: ``torch.manual_seed`` reproduces a compiled run, and patching a model does
    # not move the RNG stream that dropout and the data order use.
    start = (torch.initial_seed() + process_rank() * _RANK_STRIDE) % _SEED_MODULUS
    _step_seed_on(_device_of(model)).fill_(start)
    return _Advancing(model)


class _Advancing:
    """``model`` counts as advancing the step seed until this is called (the undo). A deep
    copy of the patched model, which copies its embedding's forward, counts as well."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        _ADVANCING_MODELS.add(model)

    def __call__(self) -> None:
        _ADVANCING_MODELS.discard(self.model)

    def __deepcopy__(self, memo) -> _Advancing:
        return _Advancing(copy.deepcopy(self.model, memo))


@torch.compiler.assume_constant_result
def _step_seed_advances() -> bool:
    # Decided at trace time: a live patched model advances the step seed.
    return len(_ADVANCING_MODELS) > 0


_PEFT_WRAPPERS = re.compile(r"\.(base_layer|lora_[AB]\.[^.:]+)(?=[.:])")


def sharing_group(slot: str) -> str:
    """The seed key of a linear input slot: the linears of one parent module, PEFT's wrappers
    left out, may share their input. ``self_attn.q_proj:input``,
    ``self_attn.k_proj.base_layer:input`` and ``self_attn.k_proj.lora_A.default:input`` are
    one group (``self_attn:input``). ``o_proj``'s input, another tensor, joins it too: that
    correlates the rounding errors of two weights' gradients, which no backward multiplies
    together (a linear's saved input makes its weight's gradient only). Other slots (norm
    inputs, attention's q and k) keep keys of their own."""
    path, _, name = _PEFT_WRAPPERS.sub("", slot).rpartition(":")
    return f"{path.rpartition('.')[0]}:{name}"


@torch.compiler.assume_constant_result
def _key_salt(key: str) -> int:
    # Called eagerly at trace time (dynamo cannot trace zlib); a constant of the key.
    return zlib.crc32(key.encode())


def _keyed_seed(seed: torch.Tensor, key: str) -> torch.Tensor:
    # A nonlinear mix (lowbias32's steps, mod the seed range), so that two keys' seeds are not
    # a fixed offset apart, which would shift one noise stream onto the other.
    mixed = seed ^ _key_salt(key)
    mixed = (mixed * 0x7FEB352D) % _SEED_MODULUS
    mixed = mixed ^ (mixed >> 15)
    return (mixed * 0x846CA68B) % _SEED_MODULUS


def traced_pack(x: torch.Tensor, codec: Codec, seed_key: str | None = None) -> Packed:
    """:meth:`PackCache.pack` in a torch.compile trace: one traced op (``hf_actq::pack``) per
    consumer. Each autograd Function is traced as a subgraph of its own, which cannot use a
    tensor another one made, so there is no cache to reuse. Instead, a stochastic codec rounds
    with a seed mixed from the step seed and ``seed_key``, the slot or, for linear inputs,
    its :func:`sharing_group`: consumers of a shared input (q/k/v, gate/up, LoRA A and its
    base) then make identical pack ops, which AOTAutograd's common-subexpression pass merges
    into one that backward keeps once, as the eager cache would. Without a key, or while no
    patched model advances the step seed (ops used on their own), each pack draws its own.

    Seeds stay on ``x``'s device for codecs whose kernels read them there (no host read; a
    CUDA graph replays them fresh). A codec that needs its seed on the host (the sampled
    rotated codec's signs) draws its own on the CPU where the step seed is on a GPU (reading
    that one would sync), so its consumers of a shared input keep a pack each there.
    """
    from hf_actq.codecs.library import compiled_pack

    seed = None
    if codec.uses_rng:
        device = x.device if codec.takes_device_seed else torch.device("cpu")
        shared = seed_key is not None and _step_seed_advances()
        if shared and (codec.takes_device_seed or step_seed().device == device):
            seed = _keyed_seed(step_seed(), seed_key).to(device)
        else:
            seed = draw_seed_tensor(device)
    return codec.pack(x) if codec.name == "exact" else compiled_pack(x, codec, seed)
