"""A registered encoder-decoder LM's head and loss (T5, mT5, BART) as one chunked linear +
cross-entropy (:mod:`hf_actq.ops.linear_cross_entropy`), bound onto the model instance's
``forward``: the stock loss keeps the log-probabilities of every target token (fp32 for an fp32
model: 125 MiB of Flan-T5-base's 346 MiB under "uniform" 4 bits at batch 8, sequence 128).

These forwards compute the decoder's inputs from the labels, scale the decoder's output (T5 with
tied embeddings), apply the head, add a final bias (BART) and take the mean cross-entropy over
targets other than -100, all inline; rather than copy that per model, the bound forward runs the
stock forward without labels (decoder inputs made by the model's own
``prepare_decoder_input_ids_from_labels``, ``use_cache`` off as the stock forward sets it when
given labels) while the head, for this call only, records its input and returns a zero-stride
stand-in for the logits, then computes the loss from that input, the head's weight and bias and
the model's ``final_logits_bias`` (BART adds it to the stand-in, which allocates one [tokens,
vocab] tensor without gradient, freed as the forward returns). "For this call only": the head's
own forward (bound at apply) asks a context variable, which each thread has its own of, so the
model used from another thread at the same time computes its logits as usual (under
torch.compile, which traces no context variable, an attribute of the head for the call). The loss is
computed in fp32 (the stock loss takes the model's dtype): equal in fp32, closer to exact in half
precision. In training with labels the output's ``logits`` is None; everywhere else (eval,
``no_grad``, no labels, heads that are not a plain ``nn.Linear``, heads with hooks or an
accelerate hook, ``return_logits=True``) the stock forward runs unchanged.
"""

from __future__ import annotations

import functools
import types
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from hf_actq.integrations.causal_lm import bound_arguments, stock_forward_after_revert
from hf_actq.integrations.patching import bind_forward
from hf_actq.ops.linear_cross_entropy import linear_cross_entropy
from hf_actq.ops.state import STATE, OpState, has_hooks, state_of

DESCRIPTION = "seq2seq lm_loss chunked linear + cross-entropy (exact; no logits kept)"


@dataclass
class _HeadInput:
    """What the head records, in the context of one fused call: its input."""

    head: nn.Module
    hidden: torch.Tensor | None = None


_RECORDING: ContextVar[_HeadInput | None] = ContextVar("hf_actq_head_input", default=None)
# Under torch.compile the recorder is the head's attribute instead: dynamo traces no ContextVar
# (each get and set was a graph break, three a step).
_RECORDING_ATTRIBUTE = "_hf_actq_head_input"


def _recording(head: nn.Module) -> _HeadInput | None:
    if not torch.compiler.is_compiling():
        recording = _RECORDING.get()
        if recording is not None:
            return recording
    return head.__dict__.get(_RECORDING_ATTRIBUTE)


def _recording_head_forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The head's forward while hf_actq is applied: inside a fused call (in this thread or
    context), record the input and return zeros of the logits' shape without allocating them
    (the stock forward only passes them on, or adds BART's ``final_logits_bias``); elsewhere the
    stock linear."""
    recording = _recording(head)
    if recording is None or recording.head is not head:
        return nn.Linear.forward(head, hidden)
    recording.hidden = hidden
    return hidden.new_zeros(()).expand(*hidden.shape[:-1], head.out_features)


def fused_seq2seq_lm_forward(self, *args, head_name: str, **kwargs):
    """The encoder-decoder LM's forward with the head and loss fused; see the module docstring."""
    if STATE not in self.__dict__:
        return stock_forward_after_revert(self, args, kwargs)
    state = state_of(self)
    head = getattr(self, head_name)
    fused = (
        not kwargs.pop("return_logits", False)
        and self.training
        and torch.is_grad_enabled()
        and type(head) is nn.Linear
        and head.__dict__.get("forward") is not None
        and head.__dict__["forward"].__func__ is _recording_head_forward
        and not has_hooks(head)
    )
    if not fused:
        return state.plain(*args, **kwargs)
    arguments, extra = bound_arguments(self, args, kwargs)
    labels = arguments.pop("labels", None)
    if labels is None:
        return state.plain(*args, **kwargs)
    return_dict = extra.pop("return_dict", arguments.pop("return_dict", None))
    if return_dict is None:  # the stock forward's default
        return_dict = getattr(self.config, "return_dict", True)
    if (
        arguments.get("decoder_input_ids") is None
        and arguments.get("decoder_inputs_embeds") is None
    ):
        arguments["decoder_input_ids"] = self.prepare_decoder_input_ids_from_labels(labels=labels)
    if arguments.get("use_cache") is None:
        arguments["use_cache"] = False
    catcher = _HeadInput(head)
    # A ModelOutput whatever the config's return_dict (its fields are read below).
    if torch.compiler.is_compiling():
        setattr(head, _RECORDING_ATTRIBUTE, catcher)
        try:
            output = state.plain(**arguments, **extra, return_dict=True)
        finally:
            delattr(head, _RECORDING_ATTRIBUTE)
    else:
        token = _RECORDING.set(catcher)
        try:
            output = state.plain(**arguments, **extra, return_dict=True)
        finally:
            _RECORDING.reset(token)
    bias = head.bias
    final_bias = getattr(self, "final_logits_bias", None)  # BART: [1, vocab], not trained
    if final_bias is not None:
        final_bias = final_bias.reshape(-1).to(catcher.hidden.dtype)
        bias = final_bias if bias is None else bias + final_bias
    loss = linear_cross_entropy(catcher.hidden, head.weight, labels.to(catcher.hidden.device), bias)
    # Rebuilt rather than assigned: a ModelOutput field that was None is not one of its keys,
    # and loss must come first (``output[0]``).
    rest = {key: value for key, value in output.items() if key not in ("loss", "logits")}
    output = type(output)(loss=loss, logits=None, **rest)
    return output.to_tuple() if return_dict is False else output


def patch_seq2seq_lm_loss(model: nn.Module, handle) -> bool:
    """Bind the fused head and loss onto ``model`` when it is an encoder-decoder LM
    (``...ForConditionalGeneration`` that makes decoder inputs from labels) with a linear head."""
    if not type(model).__name__.endswith("ForConditionalGeneration") or not hasattr(
        model, "prepare_decoder_input_ids_from_labels"
    ):
        return False
    head = model.get_output_embeddings()
    head_name = next((name for name, child in model.named_children() if child is head), None)
    if not isinstance(head, nn.Linear) or head_name is None:
        return False
    if "forward" in head.__dict__:  # an accelerate hook, or someone's own: left alone
        return False
    # The stock forward's signature stays visible (Trainer picks the dataset columns by it).
    forward = functools.wraps(type(model).forward)(
        lambda self, *args, **kwargs: fused_seq2seq_lm_forward(
            self, *args, head_name=head_name, **kwargs
        )
    )
    if not bind_forward(model, forward, OpState(path=""), "", lambda: DESCRIPTION, handle):
        return False
    handle.record(undo=functools.partial(_stop_recording, head))
    head.__dict__["forward"] = types.MethodType(_recording_head_forward, head)
    return True


def _stop_recording(head: nn.Module) -> None:
    forward = head.__dict__.get("forward")
    if getattr(forward, "__func__", None) is _recording_head_forward:
        del head.__dict__["forward"]
