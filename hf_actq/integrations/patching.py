"""Binding a compressed op's ``forward`` onto a stock module instance, and undoing it exactly.

The op's ``forward`` (a method of a module class in ``hf_actq.ops``) is bound to the instance,
its :class:`~hf_actq.ops.state.OpState` set beside it, and ``print(model)`` shows the patch.
Classes are never touched.

Accelerate's hooks (``add_hook_to_module``, which ``from_pretrained(..., device_map=...)`` and
``dispatch_model`` use) replace the instance's ``forward`` with a wrapper that calls
``_old_forward``; the op is bound there instead, so the hook keeps running around it. Any other
instance-level ``forward`` is a wrapper we cannot see into, and the module is left alone.

``nn.DataParallel`` copies each module's instance dict into its per-device replicas, so a forward
bound to the original would compute with the first device's weights (or fail on another
device); :func:`support_data_parallel` rebinds them per replica.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types

from torch import nn

from hf_actq.ops.state import STATE, OpState, set_state

logger = logging.getLogger("hf_actq")

# Where a patch keeps what ``print(model)`` shows after the module's own extra_repr, and the
# op's forward function (what :func:`runs_op` looks for).
DESCRIBE = "_hf_actq_describe"
OP_FORWARD = "_hf_actq_op_forward"


class _Missing:
    """Marks an attribute that was not there before a patch: one object that copies of a
    patched model share, so that an undo copied with the model still recognises it."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _forward_attribute(module: nn.Module) -> str | None:
    """Where the op's forward goes: ``forward``, accelerate's ``_old_forward``, or nowhere."""
    if "forward" not in module.__dict__:
        return "forward"
    if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__:
        return "_old_forward"
    return None


# How ``handle.skipped`` begins the reason of a module whose forward another library set on the
# instance; ``apply`` gathers them into one warning.
FOREIGN_FORWARD = "a forward another library set on the instance: "


def foreign_forward(module: nn.Module) -> str | None:
    """Whose forward ``module`` runs when another library (Liger-Kernel's instance patching, a
    user's wrapper) set one on the instance, as ``LigerRMSNorm.forward from liger_kernel``;
    None when the class's forward runs, or an accelerate hook's around it."""
    if _forward_attribute(module) is not None:
        return None
    function = module.__dict__["forward"]
    function = getattr(function, "__func__", function)
    function = getattr(function, "func", function)  # a functools.partial
    name = getattr(function, "__qualname__", type(function).__name__)
    package = (getattr(function, "__module__", None) or "").split(".")[0]
    return f"{name} from {package}" if package else name


def left_to_foreign_forward(module: nn.Module, path: str, handle) -> bool:
    """Whether another library set a forward on ``module``'s instance, which hf_actq leaves as
    it is (and which goes around the interfaces attention and MoE experts are patched
    through: Liger-Kernel's fused experts); recorded as skipped if so."""
    foreign = foreign_forward(module)
    if foreign is not None:
        handle.skipped[path] = FOREIGN_FORWARD + foreign
    return foreign is not None


def uncalled_children(module: nn.Module) -> list[str]:
    """Names of ``module``'s children that the forward set on its instance never names, where
    that forward is a plain function that reaches its children by attribute only. Liger-Kernel's
    SwiGLU forward, bound onto a LLaMA MLP, computes the activation in its own kernel: the MLP's
    ``act_fn`` is never called, and a patch there would claim a compression that never runs.
    A wrapper that calls another forward, or looks its children up another way, names them all
    (nothing is left out)."""
    if foreign_forward(module) is None:
        return []
    function = module.__dict__["forward"]
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None or code.co_freevars:
        return []
    names: set[str] = set()
    pending = [code]
    while pending:
        current = pending.pop()
        names.update(current.co_names)
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    if names & _DELEGATING:
        return []
    return [name for name in module._modules if name not in names]


# Names through which a forward may reach its children without naming them.
_DELEGATING = frozenset(
    (
        "forward",
        "_old_forward",
        "__call__",
        "_modules",
        "children",
        "named_children",
        "modules",
        "named_modules",
        "getattr",
        "get_submodule",
        "super",
        "__dict__",
    )
)


def bind_forward(module, op_forward, state: OpState, path: str, describe, handle) -> bool:
    """Make ``module`` run ``op_forward`` with ``state``; False if it cannot (another library
    set a forward on the instance: ``apply`` warns once for all of them).

    ``describe()`` says what the module keeps now (``print(model)`` and ``handle.patched``)."""
    if left_to_foreign_forward(module, path, handle):
        return False
    attribute = _forward_attribute(module)
    previous = module.__dict__.get(attribute, MISSING)
    # What runs when nothing is kept for backward: the forward this one replaces.
    state.plain = (
        previous if previous is not MISSING else types.MethodType(type(module).forward, module)
    )
    bound = types.MethodType(op_forward, module)
    # Bound methods and partials, not closures, throughout: ``copy.deepcopy`` of a patched
    # model rebinds them to the copy's modules, so the copy runs and reverts on its own. The
    # undo is recorded before anything changes, so that a failure part-way is undone too.
    handle.record(
        path,
        describe,
        undo=functools.partial(_unbind, module, attribute, previous, bound, state, path),
    )
    module.__dict__[attribute] = bound
    module.__dict__[OP_FORWARD] = op_forward
    set_state(module, state)
    module.__dict__[DESCRIBE] = describe
    module.__dict__["extra_repr"] = types.MethodType(_patched_extra_repr, module)
    return True


# DeepSpeed ZeRO-3 gathers, in each module's forward pre-hook, the parameters of that module
# alone, unless the module is flagged a leaf (this attribute; ``deepspeed.utils.
# set_z3_leaf_modules`` sets it), whose hook gathers its submodules' too. A fused op that reads
# its submodules' weights without calling them finds them gathered in the first forward only
# because ZeRO-3 gathers a parameter read while the engine's forward runs; a recompute in
# backward (activation checkpointing whose first pass ran the stock forward) reads them
# outside it, as empty shards. Flagged, the module's own hook gathers them wherever it runs.
# The flag is read at every gather, so it works set before or after deepspeed.initialize;
# without DeepSpeed nothing reads it.
ZERO3_LEAF = "_z3_leaf"


def gather_with_module(module: nn.Module, handle) -> None:
    """Have DeepSpeed ZeRO-3 gather ``module``'s submodules' parameters with its own (see
    ``ZERO3_LEAF``), undone with the handle."""
    previous = module.__dict__.get(ZERO3_LEAF, MISSING)
    handle.record(undo=functools.partial(_restore_attribute, module, ZERO3_LEAF, previous))
    module.__dict__[ZERO3_LEAF] = True


def set_instance_attribute(module: nn.Module, name: str, value, handle) -> None:
    """``module.__dict__[name] = value``, undone with the handle."""
    previous = module.__dict__.get(name, MISSING)
    handle.record(undo=functools.partial(_restore_attribute, module, name, previous))
    module.__dict__[name] = value


def _restore_attribute(module: nn.Module, name: str, previous) -> None:
    if previous is MISSING:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = previous


def _patched_extra_repr(module) -> str:
    inner = type(module).extra_repr(module)
    described = f"hf_actq={module.__dict__[DESCRIBE]()}"
    return f"{inner}, {described}" if inner else described


def unbind_forward(module, attribute: str, previous, bound, plain, path: str) -> bool:
    """Undo ``module.__dict__[attribute] = bound``, where ``previous`` was there before
    (``MISSING`` if nothing) and ``plain`` is what ``bound`` stands in for. False when
    something replaced ``bound`` after apply: what it put there stays."""
    # A hook added or removed after apply moved our forward between the two attributes;
    # wherever it is now, what it replaced goes back there (accelerate's wrapper calls
    # ``_old_forward``, so that one is never left empty).
    for name in ("forward", "_old_forward"):
        if module.__dict__.get(name) is bound:
            if name == attribute and previous is MISSING:
                del module.__dict__[name]
            else:
                module.__dict__[name] = plain
            return True
    if path == "":
        # The loss forwards bound onto the model run the stock forward once reverted
        # (causal_lm.stock_forward_after_revert): a wrapper around them keeps working.
        logger.info("hf_actq: the model's forward was wrapped after apply; the wrapper stays")
        return True
    return False


class Replaced(str):
    """What an undo returns for a module whose forward something replaced after apply: its
    path (the handle's revert names them all in one warning)."""


def _unbind(module, attribute: str, previous, bound, state: OpState, path: str):
    """Undo :func:`bind_forward`; ``Replaced(path)`` when another forward replaced the op."""
    restored = unbind_forward(module, attribute, previous, bound, state.plain, path)
    for name in (STATE, DESCRIBE, OP_FORWARD, "extra_repr"):
        module.__dict__.pop(name, None)
    return None if restored else Replaced(path)


def runs_op(module: nn.Module) -> bool:
    """Whether a module patched by :func:`bind_forward` still runs its op: its forward is the
    op, or a wrapper around what was there (accelerate's hook, which calls ``_old_forward``,
    and its autocast around a model's forward both carry ``__wrapped__``). Not when something
    bound a forward of its own after apply (Liger-Kernel's instance patching, which
    ``Trainer(use_liger_kernel=True)`` runs at ``train()``) or popped ours (transformers' hub
    kernels at a mode change): the module then runs that forward and keeps full tensors."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    function = getattr(forward, "__func__", forward)
    return function is module.__dict__.get(OP_FORWARD) or hasattr(function, "__wrapped__")


# What ``torch.nn.parallel.replicate`` calls on each module, per device.
REPLICATE = "_replicate_for_data_parallel"


def support_data_parallel(model: nn.Module, handle) -> None:
    """Give every module of ``model`` that holds something bound to itself (an op's forward,
    its state's stock forward, a partial over it) a replication that binds those to the
    replica instead (:func:`replicate_patched`), undone with the handle."""
    for module in model.modules():
        if REPLICATE in module.__dict__:
            continue
        if any(_bound_to(value, module) for value in module.__dict__.values()):
            module.__dict__[REPLICATE] = functools.partial(replicate_patched, module)
            handle.record(undo=functools.partial(_stop_replicating, module))


def _stop_replicating(module: nn.Module) -> None:
    module.__dict__.pop(REPLICATE, None)


def replicate_patched(module: nn.Module) -> nn.Module:
    """``nn.DataParallel``'s replica of a patched module (torch then gives it the device's
    parameters and child replicas): the stock replica, whose instance dict is a copy of
    ``module``'s, with what was bound to ``module`` bound to the replica."""
    replica = type(module)._replicate_for_data_parallel(module)
    for name, value in module.__dict__.items():
        rebound = _rebound(value, module, replica)
        if rebound is not value:
            replica.__dict__[name] = rebound
    return replica


def _bound_to(value, module: nn.Module) -> bool:
    if isinstance(value, types.MethodType):
        return value.__self__ is module
    if isinstance(value, functools.partial):
        return bool(value.args) and value.args[0] is module
    return isinstance(value, OpState) and _bound_to(value.plain, module)


def _rebound(value, original: nn.Module, replica: nn.Module):
    """``value`` bound to ``replica`` where it is bound to ``original``; else ``value`` itself."""
    if not _bound_to(value, original):
        return value
    if isinstance(value, types.MethodType):
        return types.MethodType(value.__func__, replica)
    if isinstance(value, functools.partial):
        return functools.partial(value.func, replica, *value.args[1:], **value.keywords)
    return dataclasses.replace(value, plain=_rebound(value.plain, original, replica))
