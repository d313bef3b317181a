"""``hf_actq.apply(model, config) -> handle``: patch one model instance, reversibly.

Patching binds compressed ``forward`` methods onto module *instances* (never classes), keeps
every parameter, buffer and state-dict key as it was, and records each change so that
``handle.revert()`` restores the model exactly, pre-existing instance-level forwards (accelerate
hooks) included. ``print(model)`` shows each patched module with its codec. Which model types
are known, and how, is data in :mod:`hf_actq.integrations.registry`; any other model goes
through the generic path with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from hf_actq.config import ActQConfig
from hf_actq.integrations.registry import MODEL_TYPE_TO_APPLY_FN, apply_generic

logger = logging.getLogger("hf_actq")

_HANDLE = "_hf_actq_handle"


@dataclass
class ActQHandle:
    """What :func:`apply` changed; ``revert()`` undoes all of it."""

    model: nn.Module
    config: ActQConfig
    patched: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    _undo: list = field(default_factory=list, repr=False)

    def revert(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.patched.clear()
        if getattr(self.model, _HANDLE, None) is self:
            delattr(self.model, _HANDLE)

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for description in self.patched.values():
            kind = description.split(" ", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside DDP/FSDP/accelerate and PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return model


def apply(model: nn.Module, config: ActQConfig | None = None, **kwargs) -> ActQHandle:
    """Patch ``model`` in place for compressed saved activations; returns the handle.

    Applying twice raises ValueError (revert first). Adds no parameters, so it is safe after the
    optimizer exists.
    """
    if config is None:
        config = ActQConfig(**kwargs)
    elif kwargs:
        raise ValueError("pass either an ActQConfig or keyword arguments, not both")
    if not isinstance(config, ActQConfig):
        raise ValueError(f"config must be an ActQConfig, got {type(config).__name__}")
    base = unwrap(model)
    if getattr(base, _HANDLE, None) is not None:
        raise ValueError(
            "hf_actq is already applied to this model; call handle.revert() before applying again"
        )
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    handle = ActQHandle(base, config)
    MODEL_TYPE_TO_APPLY_FN.get(model_type, apply_generic)(base, config, handle)
    if model_type not in MODEL_TYPE_TO_APPLY_FN:
        logger.warning(
            "hf_actq: model type %r has no registered patcher; the generic path patched %s",
            model_type,
            handle.summary() or "nothing",
        )
    setattr(base, _HANDLE, handle)
    return handle


def revert(model: nn.Module) -> None:
    """Undo :func:`apply` on ``model`` (no-op when it is not patched)."""
    handle = getattr(unwrap(model), _HANDLE, None)
    if handle is not None:
        handle.revert()
