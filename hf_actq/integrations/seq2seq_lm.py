"""A registered encoder-decoder LM's head and loss (T5, mT5, BART) as one chunked linear +
cross-entropy (:mod:`hf_actq.ops.linear_cross_entropy`), bound onto the model instance's
``forward``: the stock loss keeps the log-probabilities of every target token (fp32 for an fp32
model: 125 MiB of Flan-T5-base's 346 MiB under "uniform" 4 bits at batch 8, sequence 128).

These forwards compute the decoder's inputs from the labels, scale the decoder's output (T5 with
tied embeddings), apply the head, add a final bias (BART) and take the mean cross-entropy over
targets other than -100, all inline; rather than copy that per model, the bound forward runs the
stock forward without labels (decoder inputs made by the model's own
``prepare_decoder_input_ids_from_labels``, ``use_cache`` off as the stock forward sets it when
given labels) with the head swapped for a module that records its input and returns a
zero-stride stand-in for the logits, then computes the loss from that input, the head's weight
and bias and the model's ``final_logits_bias`` (BART adds it to the stand-in, which allocates
one [tokens, vocab] tensor without gradient, freed as the forward returns). The loss is computed
in fp32 (the stock loss takes the model's dtype): equal in fp32, closer to exact in half
precision. In training with
labels the output's ``logits`` is None; everywhere else (eval, ``no_grad``, no labels, heads
that are not a plain ``nn.Linear``, accelerate-hooked heads, ``return_logits=True``) the stock
forward runs unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hf_actq.integrations.causal_lm import bound_arguments, stock_forward_after_revert
from hf_actq.integrations.patching import bind_forward
from hf_actq.ops.linear_cross_entropy import linear_cross_entropy
from hf_actq.ops.state import STATE, OpState, state_of

DESCRIPTION = "seq2seq lm_loss chunked linear + cross-entropy (exact; no logits kept)"


class _HeadInput(nn.Module):
    """Stands in for the head during the stock forward: keeps the head's input and returns
    zeros of the logits' shape without allocating them (the stock forward only passes them on,
    or adds BART's ``final_logits_bias``)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.hidden = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], self.vocab)


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
        and not hasattr(head, "_hf_hook")
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
    catcher = _HeadInput(head.out_features)
    setattr(self, head_name, catcher)
    try:
        # A ModelOutput whatever the config's return_dict (its fields are read below).
        output = state.plain(**arguments, **extra, return_dict=True)
    finally:
        setattr(self, head_name, head)
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
    # The stock forward's signature stays visible (Trainer picks the dataset columns by it).
    forward = functools.wraps(type(model).forward)(
        lambda self, *args, **kwargs: fused_seq2seq_lm_forward(
            self, *args, head_name=head_name, **kwargs
        )
    )
    return bind_forward(model, forward, OpState(path=""), "", lambda: DESCRIPTION, handle)
