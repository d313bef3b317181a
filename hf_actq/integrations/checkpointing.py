"""``checkpoint_bits``: turn on a model's gradient checkpointing with packed layer inputs.

transformers' checkpointed layers (``GradientCheckpointingLayer``) call
``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``; each one gets
:func:`~hf_actq.ops.packed_checkpoint.packed_checkpoint` with the codec bound. Every attribute
touched is recorded on the handle and restored by ``revert()``, checkpointing's on/off flags
included. Anything that turns checkpointing on again later (``Trainer`` does, with
``gradient_checkpointing=True``) puts the stock function back: :func:`install` is idempotent, and
``ActQCallback`` calls it again before training.
"""

from __future__ import annotations

import functools
import logging
import re

from torch import nn

from hf_actq.integrations.patching import MISSING
from hf_actq.ops.packed_checkpoint import (
    Reparametrized,
    make_dropouts_replayable,
    packed_checkpoint,
)

logger = logging.getLogger("hf_actq")


def checkpointed_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of every layer transformers can checkpoint."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers too old to have it: nothing to hook
        return {}
    return {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, GradientCheckpointingLayer)
    }


def skip_pattern(layers: dict[str, nn.Module]) -> str | None:
    """A ``skip_modules`` regex matching the layers and everything inside them."""
    if not layers:
        return None
    return "^(" + "|".join(re.escape(path) for path in layers) + r")(\.|$)"


def enable(model: nn.Module, config, handle) -> dict[str, nn.Module]:
    """Turn on ``model``'s gradient checkpointing (recording how it was, for revert) and
    return its checkpointed layers; warn and return {} when it has none."""
    layers = checkpointed_layers(model)
    if not layers or not getattr(model, "supports_gradient_checkpointing", False):
        logger.warning(
            "hf_actq: checkpoint_bits=%s needs a transformers model whose layers support "
            "gradient checkpointing; %s has none, so its layers keep their activations as the "
            "other settings say",
            config.checkpoint_bits,
            type(model).__name__,
        )
        return {}
    # The instance attributes as they were (MISSING: the class's), so revert leaves no trace.
    before = {
        module: {name: module.__dict__.get(name, MISSING) for name in _CHECKPOINTING_ATTRIBUTES}
        for module in model.modules()
        if hasattr(module, "gradient_checkpointing")
    }
    handle.record(undo=functools.partial(_restore, before))
    if not any(layer.gradient_checkpointing for layer in layers.values()):
        hook_attributes = {name: model.__dict__.get(name, MISSING) for name in _HOOK_ATTRIBUTES}
        hooks_before = list(getattr(model, "_require_grads_hooks", None) or ())
        # Turning checkpointing on may make the input embeddings require grad (hooks); revert
        # removes those, and only those (filled in below, even if turning on fails).
        added: list = []
        handle.record(
            undo=functools.partial(_remove_input_grad_hooks, model, added, hook_attributes)
        )
        turn_on = getattr(model, "activation_checkpointing_enable", None)
        try:
            if turn_on is not None:
                turn_on(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        finally:
            hooks = getattr(model, "_require_grads_hooks", None) or ()
            added.extend(hook for hook in hooks if hook not in hooks_before)
    if not config.compress_checkpointed:
        # PEFT's LoRA dropouts replay their masks in the traced form (torch.compile).
        for layer in layers.values():
            handle.record(undo=make_dropouts_replayable(layer))
    install(layers, config)
    return layers


_CHECKPOINTING_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _restore(before: dict) -> None:
    """Put back instance attributes: ``{module: {name: value before, or MISSING}}``."""
    for module, attributes in before.items():
        for name, value in attributes.items():
            if value is MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value


# Where transformers' enable_input_require_grads keeps its hooks on the model.
_HOOK_ATTRIBUTES = ("_require_grads_hooks", "_require_grads_hook")


def _remove_input_grad_hooks(model: nn.Module, added: list, attributes: dict) -> None:
    for hook in added:
        hook.remove()
    hooks = [hook for hook in model.__dict__.get("_require_grads_hooks", ()) if hook not in added]
    if hooks:  # some were added after apply: they stay
        model._require_grads_hooks = hooks
        model._require_grads_hook = hooks[0]
        return
    _restore({model: attributes})


def install(layers: dict[str, nn.Module], config) -> None:
    """Give every checkpointed layer the packed checkpoint function (again)."""
    codec = config.codec_for_setting(
        {"codec": config.checkpoint_codec, "bits": config.checkpoint_bits}
    )
    random = []
    for path, layer in layers.items():
        # Modules inside a checkpointed layer see checkpointing off: the layer is the unit, and
        # T5's attention would otherwise set requires_grad on its zero position bias (a hack
        # for reentrant checkpointing), which a compiled graph cannot take.
        for inner in layer.modules():
            if inner is not layer and hasattr(inner, "gradient_checkpointing"):
                inner.gradient_checkpointing = False
        # The traced form (torch.compile) differentiates the layer with torch.func, which takes
        # stock ops only, not hf_actq's compressed ones inside a compressed recompute.
        traceable = not config.compress_checkpointed
        wrapper = Reparametrized(layer)
        if traceable and wrapper.draws_random_numbers:
            random.append(path)
        layer._gradient_checkpointing_func = functools.partial(
            packed_checkpoint, codec=codec, reparametrized=wrapper, layer=layer, traceable=traceable
        )
    if random:
        logger.info(
            "hf_actq: %d checkpointed layers use dropout (%s, ...); under torch.compile they run "
            "the eager packed checkpoint, a graph break each, since a traced recompute cannot "
            "replay their random numbers (set dropout to 0 to compile them whole)",
            len(random),
            random[0],
        )
