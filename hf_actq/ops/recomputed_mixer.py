"""Linear-attention token mixers kept as their packed input and run again in backward.

Qwen3.5 and Qwen3-Next mix tokens with a gated delta rule in three layers of four
(``...GatedDeltaNet``): input projections, a causal depthwise convolution, the chunked delta
rule, a gated RMSNorm and an output projection. Stock autograd keeps what each of those saves:
without flash-linear-attention's kernels, the chunked rule's fp32 intra-chunk matrices and every
chunk's state (on the tiny Qwen3.5 of the tests, 0.8 of its 1.0 MB); with them (a GPU; not
measured here), what their autograd Function keeps of the rule's inputs and intermediates, and
the projections' and the convolution's own tensors beside it. Here the mixer keeps its
input alone, packed by the slot's codec (the norm before it offers its output, so under the
recipes that share norm outputs it keeps nothing of its own), and its backward runs the stock
forward again from the unpacked input, as the "checkpoint" recipe does for whole layers
(:func:`hf_actq.ops.packed_checkpoint.packed_checkpoint`): the forward is the stock one, and the
gradient is the stock backward's at the input rounded once, every tensor inside the mixer exact
given that input.

Where it runs stock: without grad, under torch.compile, under DeepSpeed ZeRO-3 (which releases
each projection's gathered weight after its forward), and where the call would read or write
recurrent state other than its own (a cache that already holds this layer's state: generation,
or intermediate states kept for speculative decoding). A cache the model makes for a training
forward (``use_cache``) is written by the first pass as the stock forward writes it; the
recompute runs without it (a fresh cache gives the same output as none) and never holds it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

import torch
from torch import nn

from hf_actq.ops.packed_checkpoint import packed_checkpoint
from hf_actq.ops.state import state_of

logger = logging.getLogger("hf_actq")


def is_recomputed_mixer(module: nn.Module) -> bool:
    """A gated delta-rule mixer of transformers' form: ``forward(hidden_states, cache,
    attention_mask, **kwargs)`` on ``[batch, seq, hidden]``, with a ``layer_idx``."""
    return type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "layer_idx")


def recomputed_mixer_forward(self, *args, **kwargs):
    state = state_of(self)
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return state.plain(*args, **kwargs)
    if "hidden_states" in kwargs:  # the decoder layer passes it by name
        args = (kwargs.pop("hidden_states"), *args)
    # Everything but the input by name, so that the recompute can leave the cache out.
    names = _parameter_names(type(self))
    kwargs.update(zip(names[1:], args[1:]))
    args = args[:1]
    name = names[1] if len(names) > 1 and "cache" in names[1] else "cache"
    cache = kwargs.get(name)
    if not args or not _fresh(cache, self.layer_idx) or _sharded_by_zero3(self):
        return state.plain(*args, **kwargs)
    kwargs.pop(name, None)
    cache_ref = None if cache is None else weakref.ref(cache)
    return packed_checkpoint(
        functools.partial(_run, self, name, cache_ref),
        *args,
        codec=state.codecs["input"],
        reparametrized=state.reparametrized,
        pack=functools.partial(state.pack, slot="input"),
        **kwargs,
    )


def _sharded_by_zero3(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 shards ``module``'s parameters: it gathers each projection for
    its own forward and releases it after, so a recompute's backward would find it released.
    Said once a process."""
    global _told_zero3
    if not any(hasattr(p, "ds_id") for p in module.parameters()):
        return False
    if not _told_zero3:
        _told_zero3 = True
        logger.warning(
            "hf_actq: under DeepSpeed ZeRO-3 the linear-attention mixers (%s) run stock: they "
            "keep what the stock forward keeps (ZeRO-2, FSDP2, DDP and one process run them again "
            "in backward from their packed input)",
            type(module).__name__,
        )
    return True


_told_zero3 = False


def _run(module: nn.Module, name: str, cache_ref, hidden_states, *args, **kwargs):
    """The stock forward: with the model's cache in the first pass (under no_grad), without it
    in the recompute."""
    cache = cache_ref() if cache_ref is not None and not torch.is_grad_enabled() else None
    return state_of(module).plain(hidden_states, *args, **{name: cache}, **kwargs)


@functools.cache
def _parameter_names(mixer_class: type) -> tuple[str, ...]:
    """The forward's named parameters after ``self``: ``hidden_states``, then the cache
    (``cache`` in transformers 5.25, ``cache_params`` before), then ``attention_mask``."""
    parameters = list(inspect.signature(mixer_class.forward).parameters.values())[1:]
    return tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)


def _fresh(cache, layer_idx: int) -> bool:
    """Whether ``cache`` holds no state of layer ``layer_idx`` and keeps no intermediate
    states (None counts as fresh); False where it cannot tell."""
    if cache is None:
        return True
    try:
        if cache.has_previous_state(layer_idx):
            return False
        # Intermediate states for speculative decoding (transformers 5.25; none before).
        keep = getattr(cache, "get_recurrent_states_to_keep", None)
        return keep is None or not keep(layer_idx)
    except (AttributeError, IndexError, TypeError, ValueError):
        return False
