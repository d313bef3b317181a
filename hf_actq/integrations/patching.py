"""Binding a compressed op's ``forward`` onto a stock module instance, and undoing it exactly.

The op's ``forward`` (a method of a module class in ``hf_actq.ops``) is bound to the instance,
its :class:`~hf_actq.ops.state.OpState` set beside it, and ``print(model)`` shows the patch.
Classes are never touched.

Accelerate's hooks (``add_hook_to_module``, which ``from_pretrained(..., device_map=...)`` and
``dispatch_model`` use) replace the instance's ``forward`` with a wrapper that calls
``_old_forward``; the op is bound there instead, so the hook keeps running around it. Any other
instance-level ``forward`` is a wrapper we cannot see into, and the module is left alone.
"""

from __future__ import annotations

import logging
import types

from torch import nn

from hf_actq.ops.state import STATE, OpState, set_state

logger = logging.getLogger("hf_actq")

_MISSING = object()


def _forward_attribute(module: nn.Module) -> str | None:
    """Where the op's forward goes: ``forward``, accelerate's ``_old_forward``, or nowhere."""
    if "forward" not in module.__dict__:
        return "forward"
    if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__:
        return "_old_forward"
    return None


def bind_forward(module, op_forward, state: OpState, path: str, describe, handle) -> bool:
    """Make ``module`` run ``op_forward`` with ``state``; False (and a warning) if it cannot.

    ``describe()`` says what the module keeps now (``print(model)`` and ``handle.patched``)."""
    attribute = _forward_attribute(module)
    if attribute is None:
        handle.skipped[path] = "an instance-level forward that is not an accelerate hook (kept)"
        logger.warning(
            "hf_actq: %s (%s) has an instance-level forward that hf_actq does not know; it is "
            "left unpatched",
            path,
            type(module).__name__,
        )
        return False
    previous = module.__dict__.get(attribute, _MISSING)
    # What runs when nothing is kept for backward: the forward this one replaces.
    state.plain = (
        previous if previous is not _MISSING else types.MethodType(type(module).forward, module)
    )
    bound = types.MethodType(op_forward, module)
    module.__dict__[attribute] = bound
    set_state(module, state)
    base_repr = type(module).extra_repr

    def extra_repr(self=module):
        inner = base_repr(self)
        return f"{inner}, hf_actq={describe()}" if inner else f"hf_actq={describe()}"

    module.__dict__["extra_repr"] = extra_repr
    handle.describers[path] = describe
    handle.patched[path] = describe()

    def undo():
        # A hook added or removed after apply moved our forward between the two attributes;
        # wherever it is now, what it replaced goes back there.
        for name in ("forward", "_old_forward"):
            if module.__dict__.get(name) is bound:
                if name == attribute and previous is _MISSING:
                    del module.__dict__[name]
                else:
                    module.__dict__[name] = state.plain
                break
        else:
            logger.warning("hf_actq: %s's forward was replaced after apply; left as it is", path)
        for name in (STATE, "extra_repr"):
            module.__dict__.pop(name, None)

    handle._undo.append(undo)
    return True
