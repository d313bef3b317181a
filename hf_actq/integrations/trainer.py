"""``ActQCallback``: hf_actq for ``transformers.Trainer`` in one line.

    Trainer(model=model, args=args, ..., callbacks=[ActQCallback(bits=3)])

The model is patched in ``on_init_end``, before the optimizer, the DDP/FSDP wrapping and
activation checkpointing exist. When the callback is added after init, or ``model_init`` replaced
the model, it patches in ``on_train_begin`` instead (patching adds no parameters, so the existing
optimizer stays valid). On the main process it logs what it patched, and it meters the first
training step and every ``logging_steps``-th: the most bytes one forward pass left for backward
(``actq_activation_mib``; the largest micro-batch under gradient accumulation) and, on CUDA, the
step's peak allocation (``actq_peak_mib``). The figures go into the Trainer's logs and
``state.log_history``; ``log_memory=False`` turns this off. (Under FSDP the figure also holds the
gathered weights autograd keeps for backward; parameters are excluded by their local shards.)
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from hf_actq.config import ActQConfig
from hf_actq.integrations.transformers import _HANDLE, apply, unwrap
from hf_actq.memory.meter import ActivationMonitor

logger = logging.getLogger("hf_actq")


class ActQCallback(TrainerCallback):
    def __init__(
        self, config: ActQConfig | None = None, *, log_memory: bool = True, **kwargs
    ) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either an ActQConfig or keyword arguments, not both")
        self.config = config if config is not None else ActQConfig(**kwargs)
        self.handle = None
        self.log_memory = log_memory
        self.memory_history: list[dict] = []  # {"step", "activation_bytes"[, "peak_bytes"]}
        self._monitor: ActivationMonitor | None = None
        self._pending: dict | None = None

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
        if self.log_memory and model is not None:
            if self._monitor is not None:
                self._monitor.remove()
            self._monitor = ActivationMonitor(unwrap(model))

    def on_step_begin(self, args, state, control, **kwargs):
        if self._monitor is None:
            return
        # state.logging_steps is absolute even when args gives a fraction of max_steps.
        every = max(1, int(state.logging_steps or args.logging_steps or 1))
        if state.global_step == 0 or (state.global_step + 1) % every == 0:
            self._monitor.arm()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        if self._monitor is None or not self._monitor.armed:
            return
        self._monitor.disarm()
        if not self._monitor.forwards:
            return
        record = {"step": state.global_step, "activation_bytes": self._monitor.max_bytes}
        if torch.cuda.is_available():
            record["peak_bytes"] = torch.cuda.max_memory_allocated()
        self.memory_history.append(record)
        self._pending = record
        if state.is_world_process_zero and len(self.memory_history) == 1:
            logger.info(
                "hf_actq: step %d kept %.1f MiB of activations for backward",
                record["step"],
                record["activation_bytes"] / 2**20,
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is None or not state.is_world_process_zero:
            return
        figures = {"actq_activation_mib": round(self._pending["activation_bytes"] / 2**20, 3)}
        if "peak_bytes" in self._pending:
            figures["actq_peak_mib"] = round(self._pending["peak_bytes"] / 2**20, 3)
        self._pending = None
        if logs is not None:
            logs.update(figures)  # seen by the reporting callbacks that run after this one
        if state.log_history:
            state.log_history[-1].update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.remove()
            self._monitor = None
