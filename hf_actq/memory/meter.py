"""Counting what autograd holds for backward.

:class:`SavedTensorMeter` records every tensor autograd saves while it is active (through
``torch.autograd.graph.saved_tensors_hooks``, which sees ``save_for_backward`` of custom
Functions as well as built-in ops) and counts each underlying storage once, at its full size: a
view of a large tensor keeps the whole storage alive.

:func:`graph_saved_bytes` counts the same thing a second, independent way: it walks the autograd
graph behind the outputs after the forward pass and reads the tensors each node holds. The two
agree when every byte is accounted for; the memory reports check that they do. (One known gap in
the hooks: a Python number multiplied into a tensor, like PEFT LoRA's ``* scaling``, is kept as an
8-byte wrapped-number tensor without calling the hooks; the graph walk sees it.)
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from hf_actq.ops.slots import _OBSERVER, SlotObserver
from hf_actq.ops.state import observing

OP_KINDS = (
    "linear", "attention", "mlp", "norm", "activation", "dropout", "embedding", "lm_loss", "other",
)  # fmt: skip


class SavedTensorMeter:
    """Context manager: ``with SavedTensorMeter() as meter: loss = model(x)``; then
    ``meter.nbytes``.

    Tensors whose storage is in ``exclude`` (e.g. ``model.parameters()``) are not counted, which
    separates activation memory from the weights autograd also references. With ``model``, each
    storage is attributed to the innermost module running when it was first saved
    (:meth:`by_module`) and to that module's kind (:meth:`by_kind`).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), model: nn.Module | None = None):
        exclude = list(exclude)
        self._excluded = {_storage_key(t) for t in exclude}
        # DeepSpeed ZeRO-3 parameters hold an empty shard until gathered, and a gather gives
        # them a new storage: what the forward saves of them is looked up again when met.
        self._gathered = [t for t in exclude if hasattr(t, "ds_id")]
        self._storages: dict[tuple, tuple[int, str, str]] = {}
        # Weak references to the tensors saved of each storage (which keep nothing alive). A
        # storage whose every saved tensor is freed while the forward goes on saving (a graph
        # branch it drops, as GLM-4.5's group-limited routing does) is not held for backward,
        # and its address may come back for another tensor, which must then count. Storages
        # freed after the last save (the whole graph, its output dropped inside the block)
        # count as the forward kept them.
        self._saved: dict[tuple, list[weakref.ref]] = {}
        self._dropped: list[tuple[tuple[int, str, str], int]] = []  # (entry, saves before)
        self._saves = 0
        self._forward = False  # recording a forward: from __enter__ to the first unpack
        self._model = model
        self._stack: list[tuple[str, str]] = []
        self._handles: list = []
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key in self._excluded:
            return tensor
        self._saves += 1
        if key in self._storages:
            self._saved[key].append(weakref.ref(tensor, functools.partial(self._freed, key)))
            return tensor
        # Only the storages gathered now: a released one's memory may hold an activation next.
        if self._gathered and key in {_storage_key(t) for t in self._gathered}:
            return tensor
        path, kind = self._stack[-1] if self._stack else ("", "other")
        self._storages[key] = (tensor.untyped_storage().nbytes(), path, kind)
        self._saved[key] = [weakref.ref(tensor, functools.partial(self._freed, key))]
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._forward = False  # backward began: what it frees from now on was held until then
        return tensor

    def _freed(self, key: tuple, _ref) -> None:
        """A saved tensor was freed: during the forward, with every other tensor saved of its
        storage, its storage is no longer held for backward (unless no save follows)."""
        saved = self._saved.get(key)
        if self._forward and saved is not None and all(ref() is None for ref in saved):
            self._dropped.append((self._storages.pop(key), self._saves))
            del self._saved[key]

    def _held(self):
        """The entries of the storages held for backward: those alive, and those freed after
        the forward's last save."""
        yield from self._storages.values()
        yield from (entry for entry, saves in self._dropped if saves == self._saves)

    def keep(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as kept for backward where autograd's hooks do not see it (what a
        checkpointed region keeps to recompute itself), attributed as a saved one would be."""
        self._pack(tensor)

    def __enter__(self) -> SavedTensorMeter:
        if self._model is not None:
            for path, module in self._model.named_modules():
                kind = op_kind(path, module)
                self._handles.append(module.register_forward_pre_hook(self._enter(path, kind)))
                leave = observing(functools.partial(SavedTensorMeter._leave, self))
                self._handles.append(module.register_forward_hook(leave, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._forward = True
        return self

    def __exit__(self, *exc) -> None:
        self._forward = False
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, path: str, kind: str):
        def hook(module, args):
            self._stack.append((path, kind))

        return observing(hook)

    def _leave(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def by_module(self) -> dict[str, int]:
        """Bytes per module path ("" for tensors saved outside any module)."""
        return self._totals(1)

    def by_kind(self) -> dict[str, int]:
        """Bytes per op kind (see :func:`op_kind`) of the module that saved them."""
        return self._totals(2)

    def _totals(self, field: int) -> dict[str, int]:
        totals: dict[str, int] = {}
        for entry in self._held():
            totals[entry[field]] = totals.get(entry[field], 0) + entry[0]
        return totals

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages saved for backward."""
        return sum(entry[0] for entry in self._held())

    @property
    def num_storages(self) -> int:
        return sum(1 for _ in self._held())


def graph_saved_bytes(outputs, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages held by the autograd graph behind ``outputs``.

    Reads ``saved_tensors`` of custom Functions and the ``_saved_*`` fields of built-in nodes,
    before backward runs. It unpacks what saved-tensor hooks packed, so call it on graphs built
    without non-reentrant checkpointing (unpacking there would recompute the layers).
    """
    saved = graph_saved_tensors(outputs, exclude)
    return sum(tensor.untyped_storage().nbytes() for tensor in saved)


def graph_saved_tensors(outputs, exclude: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """One tensor per distinct storage the graph behind ``outputs`` holds for backward, leaving
    out the storages of ``exclude`` (see :func:`graph_saved_bytes`)."""
    excluded = {_storage_key(t) for t in exclude}
    roots = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen_nodes: set[int] = set()
    storages: dict[tuple, torch.Tensor] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for tensor in _node_saved_tensors(node):
            key = _storage_key(tensor)
            if key not in excluded:
                storages[key] = tensor
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return list(storages.values())


def _node_saved_tensors(node):
    if hasattr(node, "saved_tensors"):  # a custom autograd.Function
        values = list(node.saved_tensors)
    else:
        values = []
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                values.extend(value if isinstance(value, (list, tuple)) else [value])
    return [value for value in values if isinstance(value, torch.Tensor)]


def op_kind(path: str, module: nn.Module) -> str:
    """The kind of op a module is, by its type, for the per-kind memory breakdown.

    Attention and gated MLPs compute inside the block module itself, so a tensor saved there
    (e.g. attention probabilities, or the fused gated-MLP's packed input) counts as "attention"
    or "mlp" (MoE experts too); tensors saved by a block's child Linear count as "linear". A
    (seq2seq) LM's own tensors (the log-probabilities of the stock loss, the fused loss's
    gradient) are "lm_loss".
    """
    name = type(module).__name__
    leaf = path.rsplit(".", 1)[-1].lower()
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        return "lm_loss"  # what a (seq2seq) LM saves itself: its loss over the vocabulary
    if isinstance(module, nn.Linear) or name in ("Conv1D", "Linear4bit", "Linear8bitLt"):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.modules.dropout._DropoutNd) or "dropout" in leaf:
        return "dropout"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "Norm" in name:
        return "norm"
    if "attention" in name.lower() or "attn" in leaf or "attention" in leaf:
        return "attention"
    # Dense MLPs, T5's feed-forward, and MoE blocks, their experts and routers.
    if "MLP" in name or "DenseActDense" in name or "DenseGatedActDense" in name:
        return "mlp"
    if name.endswith(("Experts", "MoeBlock", "Router")) or leaf in (
        "mlp",
        "feed_forward",
        "ffn",
        "experts",
    ):
        return "mlp"
    if _is_activation(module):
        return "activation"
    return "other"


def _is_activation(module: nn.Module) -> bool:
    from hf_actq.ops.fewbit_activation import FewBitActivation

    if (
        isinstance(module, FewBitActivation)
        or type(module).__module__ == "torch.nn.modules.activation"
    ):
        return True
    try:
        from transformers.activations import ACT2CLS
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    classes = tuple(cls[0] if isinstance(cls, tuple) else cls for cls in ACT2CLS.values())
    return isinstance(module, classes)


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr(), storage.nbytes())


class ActivationMonitor:
    """Meters the forward passes of ``model`` while armed: ``monitor.arm()``, train, then
    ``monitor.max_bytes`` is the most bytes one forward left for backward (with gradient
    accumulation, the largest micro-batch; activations of one micro-batch are freed by its
    backward before the next forward). Only training-mode forwards with grad enabled count.
    ``remove()`` detaches it. Used by ``ActQCallback`` for its per-step logging.

    Under ``nn.DataParallel`` each replica runs in a thread of its own, with the hooks (shared
    by the replicas) and saved-tensor hooks of that thread: each is metered on its own, without
    its device's weight copies, so ``max_bytes`` is the largest replica's, one device's share."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._meters: dict[int, tuple] = {}  # by thread: meter, originals, observer token
        self._lock = threading.Lock()
        self.armed = False
        self.max_bytes = 0
        # The same forward's bytes with the tensors hf_actq compressed counted at their own
        # size: about what the unpatched model keeps, mostly less (it also keeps what hf_actq
        # regenerates or recomputes: dropout masks, logits, checkpointed layers' insides).
        self.uncompressed_bytes = 0
        self.forwards = 0
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop, always_call=True),
        ]

    def arm(self) -> None:
        self.armed, self.max_bytes, self.uncompressed_bytes, self.forwards = True, 0, 0, 0

    def disarm(self) -> None:
        self.armed = False

    def _start(self, module, args) -> None:
        # A compiled forward traces these hooks, where saved-tensor hooks cannot run: it is
        # not metered (benchmarks/bench_compile.py reads a compiled graph's saved bytes).
        if torch.compiler.is_compiling():
            return
        thread = threading.get_ident()
        if (
            self.armed
            and thread not in self._meters
            and module.training
            and torch.is_grad_enabled()
        ):
            meter = SavedTensorMeter(exclude=_parameters_read(module))
            meter.__enter__()
            originals = _Originals()
            self._meters[thread] = (meter, originals, _OBSERVER.set(originals))

    def _stop(self, module, args, output) -> None:
        entry = self._meters.pop(threading.get_ident(), None)
        if entry is not None:
            meter, originals, token = entry
            _OBSERVER.reset(token)
            meter.__exit__(None, None, None)
            with self._lock:
                if meter.nbytes >= self.max_bytes:
                    self.max_bytes = meter.nbytes
                    self.uncompressed_bytes = originals.uncompressed(meter)
                self.forwards += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Originals(SlotObserver):
    """The tensors hf_actq's ops compress in a forward: each source storage once (stock
    autograd keeps a tensor once however many ops save it), and the bytes of the packs made.
    A source is freed once packed, and its address may come back for another: a storage is
    the same only while a tensor of it is alive (weak references, which keep nothing)."""

    passive = True

    def __init__(self) -> None:
        self.live: dict[tuple, tuple[weakref.ref, int]] = {}
        self.freed_bytes = 0  # sources whose address another tensor took
        self.packed_bytes = 0

    def _source(self, x: torch.Tensor) -> None:
        key = _storage_key(x)
        seen = self.live.get(key)
        if seen is not None and seen[0]() is not None:
            return
        if seen is not None:
            self.freed_bytes += seen[1]
        self.live[key] = (weakref.ref(x), x.untyped_storage().nbytes())

    def on_pack(self, slot, x, codec, nbytes, shared_with):
        self._source(x)
        if shared_with is None:
            self.packed_bytes += nbytes

    def on_fewbit(self, slot, x, activation):
        self._source(x)
        self.packed_bytes += (x.numel() * activation.bits + 7) // 8

    def uncompressed(self, meter: SavedTensorMeter) -> int:
        """``meter``'s bytes with each compressed tensor at its own size instead of its pack
        (a source the forward also kept as it is counts once)."""
        added = self.freed_bytes + sum(
            nbytes
            for key, (ref, nbytes) in self.live.items()
            if ref() is None or key not in meter._storages
        )
        return meter.nbytes + max(0, added - self.packed_bytes)


def _parameters_read(module: nn.Module) -> list[torch.Tensor]:
    """What a forward of ``module`` reads as its weights: its parameters (FSDP2's DTensors by
    their local shards, DeepSpeed ZeRO-3's as gathered when saved), and on an
    ``nn.DataParallel`` replica, which holds none, the device copies torch's ``replicate`` gives
    each of its modules."""
    params = [getattr(p, "_local_tensor", p) for p in module.parameters()]
    for inner in module.modules():
        params.extend(t for t in getattr(inner, "_former_parameters", {}).values() if t is not None)
    return params
