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

With an adaptive config (``ActQConfig.from_recipe("alam")``) and no plan, it calibrates before
step ``calibration_step`` (the "alam" recipe: after the first step, as ALAM's code does; 0: before
the first) and again after ``recalibrate_at`` of the steps (ALAM re-plans after 10% of training,
when sensitivities have settled), on ``calibration_examples`` examples collated from the training
set (the Trainer's own data loader and RNG are not touched), logs a per-kind summary of the bits
and writes the plan to ``<output_dir>/actq_plan.json``.

Under TRL's ``SFTTrainer`` (an ``SFTConfig``) it leaves the head and loss to TRL
(``fused_loss=False``): TRL reads the logits in training, or fuses its own LM head.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_actq.adaptive.plan import BitPlan
from hf_actq.config import ActQConfig
from hf_actq.integrations import checkpointing
from hf_actq.integrations.transformers import _HANDLE, apply, unwrap
from hf_actq.memory.meter import ActivationMonitor

logger = logging.getLogger("hf_actq")

PLAN_FILE = "actq_plan.json"
# Blocks of examples a calibration tries before it gives up.
CALIBRATION_ATTEMPTS = 8


def _reads_training_logits(args) -> bool:
    """TRL's ``SFTTrainer`` (its ``SFTConfig`` and subclasses) reads ``outputs.logits`` in
    training for its entropy and token-accuracy metrics (TRL 0.x, 1.0), where the fused loss
    leaves them None; later versions compute the loss with a fused LM head of their own, around
    the model's forward, so hf_actq's would not run anyway. Told by name: TRL is not imported."""
    return any(
        cls.__name__ == "SFTConfig" and cls.__module__.startswith("trl.")
        for cls in type(args).__mro__
    )


class ActQCallback(TrainerCallback, ExportableState):
    """Patch the ``Trainer``'s model with hf_actq before the optimizer exists (the module
    docstring has the details).

    ``ActQCallback(recipe="checkpoint")`` or ``ActQCallback(bits=3)`` take the fields of
    :class:`~hf_actq.ActQConfig`: ``ActQCallback()`` is the "uniform" recipe at 4 bits
    (stochastic rounding of every compressed slot, 4-bit activation derivatives) and
    ``ActQCallback(bits=3)`` the same at 3 bits; an ``ActQConfig`` may be passed instead. An
    adaptive config is calibrated on examples of the training set and its plan saved with each
    checkpoint, so a resumed run goes on with it. With
    ``log_memory`` the logs get ``actq_activation_mib`` (the bytes autograd kept for backward)
    and, on CUDA, ``actq_peak_mib``. ``callback.handle`` is the handle; the model stays patched
    after training (``callback.handle.revert()`` undoes it).
    """

    def __init__(
        self, config: ActQConfig | dict | None = None, *, log_memory: bool = True, **kwargs
    ) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either an ActQConfig or keyword arguments, not both")
        if isinstance(config, dict):  # as the checkpoint's state() holds it
            config = ActQConfig.from_dict(config)
        self.config = config if config is not None else ActQConfig(**kwargs)
        self.handle = None
        self.log_memory = log_memory
        self.memory_history: list[dict] = []  # {"step", "activation_bytes"[, "peak_bytes"]}
        self._monitor: ActivationMonitor | None = None
        self._pending: dict | None = None
        self.calibrated_at: list[int] = []  # the steps before which a plan was computed
        self.plans: list = []  # the BitPlans computed, in order
        self.resumed_plan: dict | None = None  # a checkpoint's plan, until it is installed
        self._dataloader = None
        self._binding_checked = False
        self._applied_here = False  # whether self.handle is this callback's own

    def _ensure_patched(self, args, state, model) -> None:
        if model is None:
            return
        base = unwrap(model)
        if self.config.fused_loss and _reads_training_logits(args):
            logger.info(
                "hf_actq: TRL's %s computes its metrics from the logits (or the loss with its "
                "own fused LM head): fused_loss is off",
                type(args).__name__,
            )
            self.config = dataclasses.replace(self.config, fused_loss=False)
        current = getattr(base, _HANDLE, None)
        if current is not None:
            if current.config != self.config:
                raise ValueError(
                    "ActQCallback: the model is already patched with another config ("
                    + _differences(self.config, current.config)
                    + "): call hf_actq.revert(model) first, or give the callback the model's"
                )
            self.handle = current
            return
        self.handle = apply(base, self.config)
        self._applied_here = True
        if state is None or state.is_world_process_zero:
            _follow_log_level(args)
            logger.info("hf_actq: %s", self.handle.explain())

    def _apply_again_if_rebound(self, state) -> None:
        """``Trainer(use_liger_kernel=True)`` binds Liger-Kernel's forwards onto the model's
        norms, MLPs and the model itself in ``train()``, after this callback patched the model
        at init: those modules would run Liger's forwards while the handle counted them patched
        (and an MLP's projections, claimed by the gated op, would keep their full inputs).
        Applied again, those forwards are kept and named, and the rest runs hf_actq's ops."""
        if self.handle is None or not self._applied_here:
            return  # a handle the user made stays the user's
        lost = self.handle.unbound()
        if not lost:
            return
        base = self.handle.model
        self.handle._undo_all()  # what replaced our forwards stays
        self.handle = apply(base, self.config)
        if state is None or state.is_world_process_zero:
            logger.info(
                "hf_actq: %d patched modules were bound to other forwards after apply (%s "
                "first; use_liger_kernel binds Liger-Kernel's in train()): applied again "
                "around them: %s",
                len(lost),
                lost[0] or "the model",
                self.handle.explain(),
            )

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._ensure_patched(args, state, model)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._ensure_patched(args, state, model)
        self._apply_again_if_rebound(state)
        if self.handle is not None and self.handle.checkpointed:
            # Trainer(gradient_checkpointing=True) turned checkpointing on again after init,
            # which put the stock function back.
            checkpointing.install(self.handle.checkpointed, self.config)
        self._dataloader = train_dataloader
        if self._adaptive() and not self._resume_plan(state) and self._first_plan_due(state):
            self._calibrate(args, state)
        if self.log_memory and model is not None:
            if self._monitor is not None:
                self._monitor.remove()
            self._monitor = ActivationMonitor(unwrap(model))

    def on_step_begin(self, args, state, control, **kwargs):
        at = int(self.config.recalibrate_at * (state.max_steps or 0))
        due = self._first_plan_due(state) or (at > 0 and state.global_step == at)
        if self._adaptive() and due and state.global_step not in self.calibrated_at:
            self._calibrate(args, state)
        if self._monitor is None:
            return
        # state.logging_steps is absolute even when args gives a fraction of max_steps.
        every = max(1, int(state.logging_steps or args.logging_steps or 1))
        if state.global_step == 0 or (state.global_step + 1) % every == 0:
            self._monitor.arm()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._binding_checked and self.handle is not None:
            # After the first step: Trainer's model.train() has run, and anything that binds
            # modules again on a mode change (transformers' hub kernels) has done so.
            self._binding_checked = True
            lost = self.handle.unbound()
            if lost and state.is_world_process_zero:
                logger.warning(
                    "hf_actq: %d patched modules no longer run hf_actq's op (%s first): "
                    "something bound their forward again after apply (model.use_kernels "
                    "turned on?); call hf_actq.revert(model) and apply again",
                    len(lost),
                    lost[0] or "the model",
                )
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
            kept, originals = record["activation_bytes"], self._monitor.uncompressed_bytes
            # Near the unpatched model's bytes, and mostly below (the unpatched model also keeps
            # what hf_actq regenerates): said where it means something, not under
            # checkpointing, whose recomputed layers it cannot see.
            estimate = originals > kept and not (self.handle and self.handle.checkpointed)
            logger.info(
                "hf_actq: the first step kept %s of activations for backward%s",
                _mib(kept),
                f"; with the tensors it compressed at full size, {_mib(originals)} "
                f"({originals / max(kept, 1):.1f}x; `hf-actq memory` measures the unpatched "
                "model)"
                if estimate
                else "",
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

    def state(self) -> dict:
        """What a Trainer checkpoint keeps of this callback (``trainer_state.json``): the plan
        in force and when plans were made, so that a resumed run goes on with them."""
        plan = None if self.handle is None or self.handle.plan is None else self.handle.plan
        return {
            "args": {"config": self.config.to_dict(), "log_memory": self.log_memory},
            "attributes": {
                "calibrated_at": list(self.calibrated_at),
                "resumed_plan": None if plan is None else plan.to_dict(),
            },
        }

    def _resume_plan(self, state) -> bool:
        """On a run resumed from a checkpoint, install the plan it was training with (and
        remember when plans were made) instead of calibrating again; whether it did."""
        if state.global_step == 0:
            return False
        # Trainer(restore_callback_states_from_checkpoint=True) set these attributes on a new
        # callback; otherwise they are read from the checkpoint's trainer state.
        attributes = {"resumed_plan": self.resumed_plan, "calibrated_at": self.calibrated_at}
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        if self.resumed_plan is None and isinstance(stored, dict):
            attributes = stored.get("attributes") or {}
        self.resumed_plan = None
        if attributes.get("resumed_plan") is None:
            return False
        plan = BitPlan.from_dict(attributes["resumed_plan"])
        if plan.target_bits != self.handle.config.bits:
            logger.warning(
                "hf_actq: the checkpoint's plan is for bits=%s and this run's config asks for "
                "bits=%s: calibrating a plan for %s instead of resuming with it",
                plan.target_bits,
                self.handle.config.bits,
                self.handle.config.bits,
            )
            return False
        self.handle.set_plan(plan)
        self.plans.append(plan)
        self.calibrated_at = list(attributes.get("calibrated_at") or [])
        if state.is_world_process_zero:
            logger.info(
                "hf_actq: resumed at step %d with the checkpoint's plan (%d slots)",
                state.global_step,
                len(plan.slots),
            )
        return True

    def on_save(self, args, state, control, **kwargs):
        plan = None if self.handle is None else self.handle.plan
        folder = os.path.join(args.output_dir or "", f"checkpoint-{state.global_step}")
        if plan is not None and state.is_world_process_zero and os.path.isdir(folder):
            plan.save(os.path.join(folder, PLAN_FILE))  # beside the model, for people to read

    def _first_plan_due(self, state) -> bool:
        """Whether the first plan is to be made before this step (``calibration_step``; ALAM's
        code calibrates after the first step): none made yet, and the step reached."""
        step = (self.handle.config if self.handle is not None else self.config).calibration_step
        return not self.calibrated_at and state.global_step >= step

    def _adaptive(self) -> bool:
        config = self.handle.config if self.handle is not None else self.config
        return config.adaptive and config.plan is None and self._dataloader is not None

    def _calibrate(self, args, state) -> None:
        examples = self.handle.config.calibration_examples
        plan = None
        for attempt in range(CALIBRATION_ATTEMPTS):
            # The n-th calibration's block of examples, then the blocks after it.
            offset = len(self.calibrated_at) + attempt
            batch = calibration_batch(self._dataloader, examples, offset=offset)
            try:
                plan = self.handle.calibrate(batch)
                break
            except ValueError as error:
                logger.warning(
                    "hf_actq: calibration batch %d of %d could not be measured (%s); trying "
                    "the next one",
                    attempt + 1,
                    CALIBRATION_ATTEMPTS,
                    error,
                )
        self.calibrated_at.append(state.global_step)
        if plan is None:
            logger.warning(
                "hf_actq: no calibration batch of %d could be measured; the slots keep their "
                "current settings (%s)",
                CALIBRATION_ATTEMPTS,
                "the last plan" if self.plans else f"the even spread of {self.config.bits} bits",
            )
            return
        self.plans.append(plan)
        if state.is_world_process_zero:
            if args.output_dir:
                os.makedirs(args.output_dir, exist_ok=True)
                plan.save(os.path.join(args.output_dir, PLAN_FILE))
            summary = "; ".join(
                f"{kind}: " + ", ".join(f"{label} x{n}" for label, n in sorted(counts.items()))
                for kind, counts in sorted(plan.summary(self.handle.slots).items())
            )
            logger.info(
                "hf_actq: plan for %s bits on average before step %d (%d of %d bytes, %.1f s): %s",
                plan.target_bits,
                state.global_step,
                plan.info["bytes"],
                plan.info["budget_bytes"],
                plan.info["seconds"],
                summary,
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self._monitor is not None:
            self._monitor.remove()
            self._monitor = None


def _follow_log_level(args) -> None:
    """``TrainingArguments(log_level="info")``, which shows the Trainer's own start-of-training
    lines, shows the callback's too: where nothing has configured logging (no handler on the
    root or on "hf_actq"), one stream handler on "hf_actq" at that level. The default
    ("passive") leaves logging as it is: warnings only."""
    get_level = getattr(args, "get_process_log_level", None)
    level = get_level() if get_level is not None else logging.WARNING
    if level > logging.INFO or logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _differences(mine: ActQConfig, theirs: ActQConfig) -> str:
    """``field: this callback's value, the model's`` for each field the configs differ in."""
    a, b = mine.to_dict(), theirs.to_dict()
    keys = sorted((key for key in a if a[key] != b[key]), key=lambda key: key != "recipe")
    shown = [f"{key}: {a[key]!r} here, {b[key]!r} on the model" for key in keys[:3]]
    return "; ".join(shown + ([f"{len(keys) - 3} more"] if len(keys) > 3 else []))


def calibration_batch(dataloader, examples: int, offset: int = 0):
    """``examples`` examples of the loader's dataset, collated by its collate function: the
    ``offset``-th block of them for map-style datasets, the first ones of an iterable dataset.
    Nothing of the loader itself is iterated (accelerate's loaders keep gradient-accumulation
    state per iteration) and torch's RNG is left as it was."""
    dataset, collate = dataloader.dataset, dataloader.collate_fn
    with torch.random.fork_rng():
        if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
            start = offset * examples % max(1, len(dataset))
            indices = [(start + i) % len(dataset) for i in range(min(examples, len(dataset)))]
            return collate([dataset[i] for i in indices])
        rows = []
        for row in dataset:
            rows.append(row)
            if len(rows) == examples:
                break
        return collate(rows)
