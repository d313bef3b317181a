"""``hf_actq.apply(model, config) -> handle``: patch one model instance, reversibly.

Patching binds compressed ``forward`` methods onto module *instances* (never classes), keeps
every parameter, buffer and state-dict key as it was, and records each change so that
``handle.revert()`` restores the model exactly, pre-existing instance-level forwards (accelerate
hooks) included. ``print(model)`` shows each patched module with its codec. Which model types
are known, and how, is data in :mod:`hf_actq.integrations.registry`; any other model goes
through the generic path with a warning.
"""

from __future__ import annotations

import functools
import logging
import re
import types
from dataclasses import dataclass, field

from torch import nn

from hf_actq.adaptive.plan import BitPlan
from hf_actq.codecs.packed import ExactCodec
from hf_actq.config import ActQConfig, check_activation_setting
from hf_actq.integrations import checkpointing
from hf_actq.integrations.patching import (
    FOREIGN_FORWARD,
    MISSING,
    OP_FORWARD,
    Replaced,
    _forward_attribute,
    foreign_forward,
    runs_op,
    support_data_parallel,
    unbind_forward,
)
from hf_actq.integrations.registry import MODEL_TYPE_TO_APPLY_FN, apply_generic
from hf_actq.ops import dedup
from hf_actq.ops.fewbit_activation import ActivationTable
from hf_actq.ops.state import NOT_PICKLABLE, STATE, OpState

logger = logging.getLogger("hf_actq")

_HANDLE = "_hf_actq_handle"


@dataclass
class ActQHandle:
    """What :func:`apply` changed; ``revert()`` undoes all of it.

    ``patched``/``skipped``: module path -> what it keeps / why it was left alone. ``slots``:
    slot id -> kind of every compressed slot (the ids plans and reports use); ``plan``: the
    bit plan in force, if any; ``checkpointed``: path -> layer of the layers under packed
    checkpointing (``checkpoint_bits``).
    """

    model: nn.Module
    config: ActQConfig
    patched: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    slots: dict[str, str] = field(default_factory=dict)
    plan: BitPlan | None = None
    checkpointed: dict = field(default_factory=dict, repr=False)
    describers: dict = field(default_factory=dict, repr=False)
    _states: dict = field(default_factory=dict, repr=False)
    _undo: list = field(default_factory=list, repr=False)

    def record(self, path: str | None = None, describe=None, undo=None) -> None:
        """Record one patch, the one way patchers write to the handle: ``undo`` runs when the
        handle reverts (in reverse order; record it before the change it undoes, so that a
        failure part-way is undone too), and module ``path`` shows ``describe()`` in
        ``handle.patched`` (refreshed when a plan changes its settings)."""
        shown = describe() if path is not None else None  # a describer that fails records nothing
        if undo is not None:
            self._undo.append(undo)
        if path is not None:
            self.describers[path] = describe
            self.patched[path] = shown

    def redescribe(self, path: str) -> None:
        """Show module ``path`` in ``handle.patched`` as it is now (a later patch changed it)."""
        if path in self.describers:
            self.patched[path] = self.describers[path]()

    def add_slots(self, state: OpState, kinds: dict[str, str]) -> None:
        """Register the compressed slots of ``state`` (``kinds``: slot name -> kind)."""
        for slot, kind in kinds.items():
            if slot != "act" and isinstance(state.codecs.get(slot), (type(None), ExactCodec)):
                continue  # kept exact by the config: not a slot to allocate
            self.slots[state.slot_id(slot)] = kind
            self._states[state.slot_id(slot)] = (state, slot)

    def set_plan(self, plan: BitPlan) -> None:
        """Give every slot the setting ``plan`` names. A ValueError (a plan that does not name
        exactly this model's slots, or a setting a slot cannot take, named) changes nothing."""
        plan.check_slots(self.slots)
        changes = []
        for slot_id, setting in plan.slots.items():
            state, slot = self._states[slot_id]
            try:
                codec_setting = isinstance(setting, dict) and "codec" in setting
                if slot == "act" and codec_setting and not state.act_codec:
                    raise ValueError(
                        "only a standalone activation can keep its input with a codec; this "
                        "one keeps a few-bit code ({'bits': 1..4})"
                    )
                if slot == "act" and not codec_setting:
                    check_activation_setting(setting)
                    act = state.activation
                    value = ActivationTable(act.spec.name, setting["bits"], act.params)
                else:
                    value = self.config.codec_for_setting(setting)
            except ValueError as error:
                raise ValueError(f"bit plan: slot {slot_id!r}: {error}") from None
            changes.append((state, slot, value))
        for state, slot, value in changes:
            if isinstance(value, ActivationTable):
                state.activation = value
                state.codecs.pop("act", None)  # the few-bit code, not a packed input
            else:
                state.codecs[slot] = value
        self.plan = plan
        for path in self.describers:
            self.redescribe(path)

    def list_slots(self, batch) -> dict:
        """Slot id -> :class:`~hf_actq.adaptive.calibrate.SlotInfo` (shape, codec, bytes,
        shared packed tensor) of every slot one forward on ``batch`` fills."""
        from hf_actq.adaptive.calibrate import list_slots

        return list_slots(self, batch)

    def calibrate(self, batch, **options) -> BitPlan:
        """Measure, allocate and install a plan for ``config.bits`` on average (the adaptive
        pass, :func:`hf_actq.adaptive.calibrate`); returns the plan."""
        from hf_actq.adaptive.calibrate import calibrate

        plan = calibrate(self, batch, **options)
        self.set_plan(plan)
        return plan

    def revert(self) -> None:
        replaced = self._undo_all()
        if replaced:
            logger.warning(
                "hf_actq: %s replaced after apply (%s first); what replaced it stays",
                "1 patched module had its forward"
                if len(replaced) == 1
                else f"{len(replaced)} patched modules had their forward",
                replaced[0] or "the model",
            )

    def _undo_all(self) -> list[str]:
        """Undo every change; the paths whose forward something else replaced after apply."""
        replaced = [path for undo in reversed(self._undo) if isinstance(path := undo(), Replaced)]
        replaced.reverse()  # in the order they were patched
        self._undo.clear()
        self.patched.clear()
        if getattr(self.model, _HANDLE, None) is self:
            delattr(self.model, _HANDLE)
        return replaced

    def unbound(self) -> list[str]:
        """Paths of patched modules whose op is no longer their forward: something bound them
        again after apply (Liger-Kernel's instance patching, transformers' hub kernels turned
        back on), so they run that forward and keep what it keeps."""
        lost = []
        for path, module in self.model.named_modules():
            if OP_FORWARD in module.__dict__:
                if not runs_op(module):
                    lost.append(path)
            elif STATE in module.__dict__ and foreign_forward(module) is not None:
                # Attention and experts: their class's forward calls the op through
                # transformers' interface; a forward set on the instance goes around it.
                lost.append(path)
        return lost

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for description in self.patched.values():
            kind = description.split(" ", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))

    def explain(self) -> str:
        """One line on what ``apply`` did: the recipe and what it keeps, the modules patched by
        kind, and those left stock, grouped by why (a path of each)."""
        line = self.config.describe()
        if self.config.recipe:
            line = f'"{self.config.recipe}" ({line})'
        line += f": patched {self.summary() or 'nothing'}"
        if self.checkpointed:
            line += f", {len(self.checkpointed)} layers checkpointed"
        reasons: dict[str, list[str]] = {}
        for path, why in self.skipped.items():
            if path not in self.checkpointed:  # run stock inside the packed checkpoint
                reasons.setdefault(why, []).append(path)
        if reasons:
            groups = [
                f"{len(paths)} {why} ({paths[0] or 'the model'}{', ...' if len(paths) > 1 else ''})"
                for why, paths in sorted(reasons.items(), key=lambda item: -len(item[1]))
            ]
            line += f"; left stock: {'; '.join(groups)}"
        return line


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside DDP/FSDP/accelerate, PEFT and ``torch.compile`` wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            # torch.compile's OptimizedModule: patching the module it wraps keeps the slot ids
            # (and plans) of the uncompiled model; dynamo recompiles on the changed forwards.
            model = model._orig_mod
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
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    base = unwrap(model)
    if config.checkpoint_bits is not None and _prefix_tuned(model):
        raise ValueError(
            "the 'checkpoint' recipe (checkpoint_bits) turns on gradient checkpointing, which "
            "transformers cannot run under PEFT prefix tuning (the prefix enters as a cache, "
            "and checkpointed layers drop the cache: the attention mask no longer fits); use "
            "recipe='uniform' or 'alam' for a prefix-tuned model"
        )
    if getattr(base, _HANDLE, None) is not None:
        raise ValueError(
            "hf_actq is already applied to this model; call handle.revert() before applying again"
        )
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    handle = ActQHandle(base, config)
    # All or nothing: whatever fails part-way (a bad plan, an error inside a patcher, an
    # interrupt), what was done is undone and the model is as it was.
    try:
        _patch(base, config, handle, model_type)
    except BaseException:
        handle.revert()
        raise
    _warn_foreign_forwards(handle)
    if model_type not in MODEL_TYPE_TO_APPLY_FN:
        logger.warning(
            "hf_actq: model type %r has no registered patcher; the generic path patched %s",
            model_type,
            handle.summary() or "nothing",
        )
    return handle


def _warn_foreign_forwards(handle: ActQHandle) -> None:
    """One warning for every module whose forward another library set on the instance (under
    Liger-Kernel's instance patching, every norm and MLP of a model), grouped by that forward."""
    by_forward: dict[str, list[str]] = {}
    for path, why in handle.skipped.items():
        if why.startswith(FOREIGN_FORWARD):
            by_forward.setdefault(why.removeprefix(FOREIGN_FORWARD), []).append(path)
    if not by_forward:
        return
    count = sum(len(paths) for paths in by_forward.values())
    logger.warning(
        "hf_actq: %s a forward that another library set on the instance, which hf_actq leaves "
        "as it is (what that forward keeps for backward stays as it was): %s",
        "1 module runs" if count == 1 else f"{count} modules run",
        "; ".join(
            f"{forward} on {len(paths)} ({paths[0] or 'the model'}"
            f"{', ...' if len(paths) > 1 else ''})"
            for forward, paths in by_forward.items()
        ),
    )


def _prefix_tuned(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model whose active adapter is prefix tuning."""
    active = getattr(model, "active_peft_config", None)
    return str(getattr(active, "peft_type", "")).endswith("PREFIX_TUNING")


def _patch(base: nn.Module, config: ActQConfig, handle: ActQHandle, model_type) -> None:
    plan = _load_plan(config.plan)
    guard = base.register_forward_pre_hook(_PickleGuard())
    handle.record(undo=guard.remove)
    _suspend_hub_kernels(base, handle)
    patch_config = config
    if config.checkpoint_bits is not None:
        handle.checkpointed = checkpointing.enable(base, config, handle)
        if handle.checkpointed and not config.compress_checkpointed:
            skip = checkpointing.skip_pattern(handle.checkpointed)
            patch_config = config.replace(skip_modules=[*config.skip_modules, skip])
    MODEL_TYPE_TO_APPLY_FN.get(model_type, apply_generic)(base, patch_config, handle)
    _check_settings_match(base, config)
    _advance_step_seed_per_forward(base, handle)
    support_data_parallel(base, handle)
    if plan is not None:
        handle.set_plan(plan)
    elif config.adaptive:
        logger.warning(
            "hf_actq: adaptive precision needs a calibration batch: call "
            "handle.calibrate(batch) (ActQCallback does it before the first step); until then "
            "every slot keeps the even spread of %s bits",
            config.bits,
        )
    setattr(base, _HANDLE, handle)


def _suspend_hub_kernels(model: nn.Module, handle: ActQHandle) -> None:
    """Turn transformers' hub kernels off for ``model`` while it is patched.

    transformers (5.x, with the ``kernels`` package it depends on) loads a model with
    ``use_kernels`` on and kernelizes it again at every ``train()`` or ``eval()`` that changes
    the mode, which sets or pops the instance-level forward of every module decorated for hub
    kernels (GELU and SiLU activations, RMSNorms): where hf_actq binds its ops. Left on, the
    ``Trainer``'s first ``model.train()`` silently put the stock modules back (MiniLM's GELUs
    kept their full inputs for backward). Revert turns the kernels back on,
    in the mode they had. A CPU had no kernel to lose: the hub's mapping has none for it."""
    for module in model.modules():
        if not getattr(module, "_use_kernels", False) or not hasattr(module, "reset_kernels"):
            continue
        mode = getattr(module, "_kernels_mode", None)
        module.reset_kernels()
        handle.record(undo=functools.partial(_resume_hub_kernels, module, mode))
        logger.info(
            "hf_actq: transformers' hub kernels (use_kernels) would replace the forwards hf_actq "
            "binds at every train()/eval(); they are off for %s while it is patched",
            type(module).__name__,
        )


def _resume_hub_kernels(module: nn.Module, mode) -> None:
    try:
        module.set_use_kernels(True, getattr(module, "kernel_config", None), mode=mode)
    except Exception as error:  # noqa: BLE001 (a hub download, a kernel: revert must finish)
        logger.warning(
            "hf_actq: revert could not turn %s's hub kernels back on (%s); "
            "model.set_use_kernels(True) retries",
            type(module).__name__,
            error,
        )


def _check_settings_match(model: nn.Module, config: ActQConfig) -> None:
    """A ``slots`` key that names no slot of the patched model is a ValueError (a mistyped id
    would be ignored); a ``slots`` regex or a ``skip_modules`` pattern that matches nothing is
    warned about (a config shared between models may hold one for another model)."""
    slot_ids = set()
    for module in model.modules():
        state = module.__dict__.get(STATE)
        if state is not None:
            slots = [*state.codecs, *(["act"] if state.activation is not None else [])]
            slot_ids.update(state.slot_id(slot) for slot in slots)
    for key in config.slots:
        if key.startswith("re:"):
            if not any(re.search(key[3:], slot) for slot in slot_ids):
                logger.warning("hf_actq: slots[%r] matches no slot of this model", key)
        elif key not in slot_ids:
            raise ValueError(
                f"slots[{key!r}] names no slot of this model (handle.slots lists the ids, "
                "'<module path>:<slot>'; a skipped module has none)"
            )
    paths = [path for path, _ in model.named_modules()]
    for pattern in config.skip_modules:
        if not any(re.search(pattern, path) for path in paths):
            logger.warning("hf_actq: skip_modules pattern %r matches no module path", pattern)


class _PickleGuard:
    """A forward pre-hook that does nothing but refuse pickling with a message that says what
    to do. A module's hooks are pickled before its submodules, so this is met before anything
    else a patched model holds that cannot be pickled (an op's weak references, transformers'
    own checkpointing hook)."""

    def __call__(self, module, args) -> None:
        return None

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLABLE)

    def __deepcopy__(self, memo) -> _PickleGuard:
        return _PickleGuard()


def _load_plan(plan) -> BitPlan | None:
    if plan is None or isinstance(plan, BitPlan):
        return plan
    return BitPlan.load(plan)


def revert(model: nn.Module) -> None:
    """Undo :func:`apply` on ``model`` (no-op when it is not patched)."""
    handle = getattr(unwrap(model), _HANDLE, None)
    if handle is not None:
        handle.revert()


def _advance_step_seed_per_forward(model: nn.Module, handle: ActQHandle) -> None:
    """Under torch.compile, the consumers of a shared input round it with one seed mixed from
    a step seed, so that they keep it packed once (see hf_actq.ops.dedup.traced_pack). The
    step seed advances in the input embedding's forward: a hook on a module whose forward or
    hooks break the graph (transformers' logging, PEFT's requires_grad hook) breaks it once
    more, and the embedding's do not."""
    handle.record(undo=dedup.start_step_seed(model))
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    attribute = _forward_attribute(embedding) if isinstance(embedding, nn.Module) else None
    if attribute is None:  # no embedding we can bind onto: the model's own pre-hook
        hook = model.register_forward_pre_hook(dedup.advance_step_seed)
        handle.record(undo=hook.remove)
        return
    previous = embedding.__dict__.get(attribute, MISSING)  # accelerate's wrapper calls this
    inner = (
        previous
        if previous is not MISSING
        else types.MethodType(type(embedding).forward, embedding)
    )
    # Bound methods and partials, not closures: deepcopy rebinds them to the copy.
    bound = types.MethodType(dedup.step_seed_forward, embedding)
    handle.record(
        undo=functools.partial(_stop_advancing_in, embedding, attribute, previous, bound, inner)
    )
    embedding.__dict__[dedup.INNER_FORWARD] = inner
    embedding.__dict__[attribute] = bound


def _stop_advancing_in(embedding: nn.Module, attribute: str, previous, bound, inner):
    restored = unbind_forward(embedding, attribute, previous, bound, inner, "the input embedding")
    embedding.__dict__.pop(dedup.INNER_FORWARD, None)
    return None if restored else Replaced("the input embedding")
