"""Counting what autograd holds for backward.

:class:`SavedTensorMeter` records every tensor autograd saves while it is active (through
``torch.autograd.graph.saved_tensors_hooks``, which sees ``save_for_backward`` of custom
Functions as well as built-in ops) and counts each underlying storage once, at its full size: a
view of a large tensor keeps the whole storage alive.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensorMeter:
    """Context manager: ``with SavedTensorMeter() as meter: loss = model(x)``; then
    ``meter.nbytes``.

    Tensors whose storage is in ``exclude`` (e.g. ``model.parameters()``) are not counted, which
    separates activation memory from the weights autograd also references. With ``model``, each
    storage is attributed to the innermost module running when it was first saved
    (:meth:`by_module`).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), model: torch.nn.Module | None = None):
        self._excluded = {_storage_key(t) for t in exclude}
        self._storages: dict[tuple, tuple[int, str]] = {}
        self._model = model
        self._stack: list[str] = []
        self._handles: list = []
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._excluded and key not in self._storages:
            owner = self._stack[-1] if self._stack else ""
            self._storages[key] = (tensor.untyped_storage().nbytes(), owner)
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        if self._model is not None:
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._handles.append(module.register_forward_hook(self._leave_module))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_module(self, name):
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _leave_module(self, module, args, output):
        self._stack.pop()

    def by_module(self) -> dict[str, int]:
        """Bytes per module path ("" for tensors saved outside any module)."""
        totals: dict[str, int] = {}
        for nbytes, owner in self._storages.values():
            totals[owner] = totals.get(owner, 0) + nbytes
        return totals

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct storages saved for backward."""
        return sum(nbytes for nbytes, _ in self._storages.values())

    @property
    def num_storages(self) -> int:
        return len(self._storages)


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr(), storage.nbytes())
