"""A registered causal LM's head and loss as one chunked linear + cross-entropy
(:mod:`hf_actq.ops.linear_cross_entropy`), bound onto the model instance's ``forward``.

The stock forward of every registered decoder, and of the registered vision-language models'
``...ForConditionalGeneration``, is: base model, hidden states of the kept positions,
``lm_head``, optional final soft-capping, ``self.loss_function``. While training
with labels (grad enabled, ``model.training``), the bound forward runs the base model with the
same arguments and computes the loss from the hidden states directly, so no [tokens, vocab]
tensor is kept or materialised; the output's ``logits`` is None then. Everywhere else (eval,
``no_grad``, no labels: generation, Trainer's label smoothing, which calls the model without
labels) and for heads it cannot read exactly (a head that is not a plain ``nn.Linear``, such as a
LoRA-adapted or 4-bit head; a head with an accelerate hook, which may move or load its weight;
a loss other than transformers' ``ForCausalLMLoss``: a custom ``loss_type`` or
``loss_function``; a head with torch hooks, which must run), the stock forward runs unchanged.
A mixture of experts' load-balancing loss (``output_router_logits``) is added as the stock
forward adds it, by the model's own ``load_balancing_loss_func``, and returned as ``aux_loss``;
a model with an auxiliary loss in another form runs the stock forward.
Set ``ActQConfig(fused_loss=False)``, or pass ``return_logits=True`` to a call, where a training
loop needs the logits.
"""

from __future__ import annotations

import functools
import inspect
import typing

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from hf_actq.integrations.patching import bind_forward
from hf_actq.ops.linear_cross_entropy import IGNORE_INDEX, causal_lm_loss
from hf_actq.ops.state import STATE, OpState, has_hooks, state_of

DESCRIPTION = "lm_loss chunked linear + cross-entropy (exact; no logits kept)"


def fused_causal_lm_forward(self, *args, logit_scale_of=None, softcap_of=None, **kwargs):
    """The causal LM's forward with the head and loss fused; see the module docstring.
    ``logit_scale_of(config)`` is what the stock head multiplies its logits by (None: 1),
    ``softcap_of(config)`` the soft-cap it applies (None: the config's
    ``final_logit_softcapping``)."""
    if STATE not in self.__dict__:
        return stock_forward_after_revert(self, args, kwargs)
    state = state_of(self)
    head = self.get_output_embeddings()
    fused = (
        not kwargs.pop("return_logits", False)
        and self.training
        and torch.is_grad_enabled()
        and type(head) is nn.Linear  # a patched nn.Linear keeps its class
        # accelerate's hooks may move or load the head's weight in its forward, and a user's
        # hooks must run: call it.
        and not hasattr(head, "_hf_hook")
        and not has_hooks(head)
        and self.loss_function is ForCausalLMLoss  # what the fused loss computes
    )
    if not fused:
        return state.plain(*args, **kwargs)
    arguments, extra = bound_arguments(self, args, kwargs)
    labels = arguments.pop("labels", None)
    shift_labels = extra.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        return state.plain(*args, **kwargs)
    if not (
        isinstance(logits_to_keep := arguments.pop("logits_to_keep", 0), int)
        and logits_to_keep == 0
    ):
        return state.plain(*args, **kwargs)  # training computes every position's loss
    output_class = _output_class(type(self))
    router_loss = None
    if "aux_loss" in _field_names(output_class):
        router_loss = _router_loss(self, arguments)
        if router_loss is False:  # an auxiliary loss the fused path does not know: stock
            return state.plain(*args, **kwargs)
    return_dict = extra.pop("return_dict", arguments.pop("return_dict", None))
    if return_dict is None:  # the stock forward's default
        return_dict = getattr(self.config, "return_dict", True)
    num_items_in_batch = extra.get("num_items_in_batch")
    base = getattr(self, self.base_model_prefix)
    if "labels" in _forward_signature(type(base))[0].parameters:
        arguments["labels"] = labels  # Gemma 3's stock head passes them on to its base model
    outputs = base(**arguments, **extra)
    loss = causal_lm_loss(
        outputs[0],
        head.weight,
        labels,
        head.bias,
        shift_labels=shift_labels,
        softcap=(
            getattr(self.config, "final_logit_softcapping", None)
            if softcap_of is None
            else softcap_of(self.config)
        ),
        logit_scale=1.0 if logit_scale_of is None else logit_scale_of(self.config),
        num_items_in_batch=num_items_in_batch,
        # The stock forward hands its extra keywords to the loss too (and to the base model).
        ignore_index=extra.get("ignore_index", IGNORE_INDEX),
    )
    extra_fields = {}
    if router_loss is not None:
        # A mixture of experts' load-balancing loss, added as the stock forward adds it.
        aux_loss = router_loss(outputs.router_logits)
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        extra_fields["aux_loss"] = aux_loss
    # Every other field (cache, hidden states, router logits, a vision-language model's image
    # outputs) is the base model's, as in the stock forward.
    passed = {
        name: getattr(outputs, name, None)
        for name in _field_names(output_class)
        if name not in ("loss", "logits", *extra_fields)
    }
    output = output_class(loss=loss, logits=None, **extra_fields, **passed)
    return output.to_tuple() if return_dict is False else output


def _field_names(output_class) -> tuple[str, ...]:
    # The class's own field table: dynamo fails on ``dataclasses.fields`` of a class (a graph
    # break at each of its calls in a compiled step). A ModelOutput has no pseudo-fields.
    return tuple(output_class.__dataclass_fields__)


def _router_loss(model, arguments: dict):
    """Where the stock forward adds a mixture of experts' load-balancing loss (the output has an
    ``aux_loss`` and the call asks for router logits): that loss, as a function of the router
    logits, computed by the model's own module-level ``load_balancing_loss_func`` as the stock
    forward calls it; None where the call adds nothing; False where the model has an auxiliary
    loss in a form this does not know (the fused loss then stands aside)."""
    wants = arguments.get("output_router_logits")
    if wants is None:
        wants = getattr(model.config, "output_router_logits", False)
    if not wants:
        return None
    function = getattr(inspect.getmodule(type(model)), "load_balancing_loss_func", None)
    needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if function is None or not all(hasattr(model, name) for name in needed):
        return False
    return functools.partial(
        _call_load_balancing,
        function,
        model.num_experts,
        model.num_experts_per_tok,
        arguments.get("attention_mask"),
    )


def _call_load_balancing(function, num_experts, top_k, attention_mask, router_logits):
    return function(router_logits, num_experts, top_k, attention_mask)


@functools.cache
def _output_class(cls) -> type[ModelOutput]:
    """The output class the stock forward returns (from its annotation, ``tuple | ...``)."""
    annotation = inspect.signature(cls.forward).return_annotation
    for candidate in (annotation, *typing.get_args(annotation)):
        if (
            isinstance(candidate, type)
            and issubclass(candidate, ModelOutput)
            and {"loss", "logits"} <= set(_field_names(candidate))
        ):
            return candidate
    return CausalLMOutputWithPast


def stock_forward_after_revert(model, args, kwargs):
    """Called once ``model`` was reverted: a wrapper installed after apply (accelerate's
    mixed-precision forward, which ``Trainer`` installs with ``bf16=True``; TRL's fused LM head)
    still holds the patched forward, and revert cannot take it out of the wrapper. The stock
    forward runs instead, so the reverted model works under its wrappers."""
    kwargs.pop("return_logits", None)
    return type(model).forward(model, *args, **kwargs)


def bound_arguments(model, args, kwargs) -> tuple[dict, dict]:
    """A call's arguments to ``model``'s stock forward by name, and its ``**kwargs`` apart."""
    signature, var_keyword = _forward_signature(type(model))
    arguments = dict(signature.bind(model, *args, **kwargs).arguments)
    arguments.pop("self")
    return arguments, arguments.pop(var_keyword, None) or {}


@functools.cache
def _forward_signature(cls) -> tuple[inspect.Signature, str | None]:
    """The class's stock forward signature and its ``**kwargs`` name, once per class (not on
    every training step)."""
    signature = inspect.signature(cls.forward)
    kinds = {p.kind: p.name for p in signature.parameters.values()}
    return signature, kinds.get(inspect.Parameter.VAR_KEYWORD)


def patch_causal_lm_loss(model: nn.Module, handle, logit_scale_of=None, softcap_of=None) -> bool:
    """Bind the fused head and loss onto ``model`` when it is a causal LM (``...ForCausalLM``,
    ``...LMHeadModel``; not multi-task heads such as GPT-2's double heads; a decoder-only
    ``...ForConditionalGeneration``: a vision-language model) with a linear head;
    ``logit_scale_of(config)`` is what its stock head multiplies the logits by, and
    ``softcap_of(config)`` its soft-cap where the config's ``final_logit_softcapping`` is not."""
    name = type(model).__name__
    vision_language = name.endswith("ForConditionalGeneration") and not getattr(
        model.config, "is_encoder_decoder", False
    )
    if not (name.endswith(("ForCausalLM", "LMHeadModel")) or vision_language):
        return False
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or not hasattr(model, model.base_model_prefix or "-"):
        return False
    # The stock forward's signature stays visible (Trainer picks the dataset columns to keep
    # from it, and would drop ``input_ids`` for a bare ``*args, **kwargs``).
    forward = functools.wraps(type(model).forward)(
        lambda self, *args, **kwargs: fused_causal_lm_forward(
            self, *args, logit_scale_of=logit_scale_of, softcap_of=softcap_of, **kwargs
        )
    )
    return bind_forward(model, forward, OpState(path=""), "", lambda: DESCRIPTION, handle)
