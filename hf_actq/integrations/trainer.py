"""``ActQCallback``: hf_actq for ``transformers.Trainer`` in one line.

    Trainer(model=model, args=args, ..., callbacks=[ActQCallback(bits=3)])

The model is patched in ``on_init_end``, before the optimizer, the DDP/FSDP wrapping and
activation checkpointing exist. When the callback is added after init, or ``model_init`` replaced
the model, it patches in ``on_train_begin`` instead (patching adds no parameters, so the existing
optimizer stays valid). On the main process it logs what it patched and, on the first training
step, the bytes autograd kept for backward.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from hf_actq.config import ActQConfig
from hf_actq.integrations.transformers import _HANDLE, apply, unwrap

logger = logging.getLogger("hf_actq")


class ActQCallback(TrainerCallback):
    def __init__(self, config: ActQConfig | None = None, **kwargs) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either an ActQConfig or keyword arguments, not both")
        self.config = config if config is not None else ActQConfig(**kwargs)
        self.handle = None

    def _ensure_patched(self, state, model) -> None:
        if model is None:
            return
        base = unwrap(model)
        current = getattr(base, _HANDLE, None)
        if current is not None:
            self.handle = current
            return
        self.handle = apply(base, self.config)
        if state is None or state.is_world_process_zero:
            logger.info("hf_actq: patched %s (%s)", self.handle.summary() or "nothing", self.config)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._ensure_patched(state, model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._ensure_patched(state, model)
