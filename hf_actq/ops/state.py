"""What a compressed op keeps on its module besides the module's own parameters, and the rules
every compressed ``forward`` shares.

Each compressed op is an ``nn.Module`` whose ``forward`` reads parameters and submodules under
the names the stock module uses (``weight``, ``bias``, ``gate_proj``, ...) and everything else
from one :class:`OpState` attribute. ``hf_actq.apply`` binds that very ``forward`` onto the stock
module instances it patches (as Liger-Kernel binds its modules' methods), so a standalone op and
a patched model run the same code under the same rules:

- backward needed in training mode (grad enabled and any input or parameter requires grad):
  the compressed autograd Function runs and keeps its packed buffers;
- otherwise (eval mode included) the stock forward runs and nothing is packed; in training mode the op still draws
  the RNG seeds its packing would have drawn (:func:`keep_rng_stream`), because reentrant
  checkpointing runs its first pass under ``no_grad`` and its recompute with grad, and both must
  leave the RNG where the other does, or every dropout after the op draws a different mask.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._C import _functions

from hf_actq.codecs import AverageQuantCodec
from hf_actq.codecs.packed import Codec, Packed, capturing_cuda_graph, skip_seeds
from hf_actq.kernels.registry import runs_kernels
from hf_actq.ops.dedup import DEFAULT_CACHE, PackCache
from hf_actq.ops.slots import observer, per_slot_seeds

STATE = "_hf_actq"
NOT_PICKLABLE = (
    "a model patched by hf_actq cannot be pickled (it holds bound forwards and weak references "
    "to live tensors): call handle.revert() (or hf_actq.revert(model)) first, or save the "
    "weights with model.save_pretrained() or model.state_dict()"
)


@dataclass(eq=False)
class OpState:
    """``plain`` is the stock forward, run when nothing is kept for backward (set when a
    standalone op is built or an op is bound onto a module); ``codecs`` the codec of each slot
    the op fills (see :mod:`hf_actq.ops.slots`; None keeps a slot exact); ``path`` the module's
    path, which prefixes its slot ids; ``cache`` shares packed inputs between ops."""

    plain: Callable | None = None
    codecs: dict[str, Codec | None] = field(default_factory=dict)
    path: str = ""
    cache: PackCache = field(default=DEFAULT_CACHE)
    # Few-bit activations and gated MLPs: the activation and its derivative table (the "act"
    # slot); a gated MLP's activation module it was made for, and whether the warning that it
    # was replaced by one hf_actq cannot fuse has been given.
    activation: object | None = None
    act_module: object | None = None
    warned_activation: bool = False
    # Standalone activations: whether the "act" slot may keep the input with a codec (in
    # ``codecs["act"]``) instead of a few-bit code of the derivative.
    act_codec: bool = False
    # RMSNorm's epsilon (the stock modules call it ``variance_epsilon`` or ``eps``), what its
    # output is scaled by besides the weight (1 for Gemma's ``(1 + w)``), and whether that scale
    # is applied in fp32 before the cast (Gemma's, OLMo-2's, gpt-oss's) or after it (LLaMA's).
    eps: float | None = None
    norm_offset: float = 0.0
    norm_fp32_scale: bool = False
    # RMSNorm: that (offset, fp32 scale) form per (input dtype, weight dtype), None where the
    # module computes none of the forms (checked per pair as met: a model may be cast after
    # apply).
    norm_forms: dict = field(default_factory=dict)
    # Dropout: "seed" or "mask".
    dropout_mode: str = "seed"
    # Gated MLPs patched with plain nn.Linear projections (the fused path), and whether the
    # warning that one was replaced later has been given.
    fused_projections: bool = False
    warned_replaced: bool = False
    # Attention: the implementation to run where nothing is kept for backward (eval, no_grad),
    # and how K is laid out when packed ("head" or "sequence", ActQConfig.key_layout).
    attention_fallback: str | None = None
    # The model's own eager attention function, which the eager-recompute op runs and
    # differentiates again in backward.
    attention_function: Callable | None = None
    key_layout: str = "head"
    # MoE experts: the ``ExpertsInterface`` implementation to run where nothing is kept, and
    # the PEFT ``ParamWrapper`` of each parameter name that one wraps (LoRA on the parameter).
    experts_fallback: str | None = None
    lora_wrappers: dict = field(default_factory=dict)
    # Norms: keep the output (which the next layer keeps anyway) instead of the input, and
    # rebuild the normalized input from it in backward.
    norm_from_output: bool = False
    # Compressed norms: offer the output to the next ops as rebuilt from the packed input; a q/k
    # norm also holds its latest offer's cache entry while its attention module's forward runs
    # (attention takes it through RoPE: ops/rotary.py).
    offer_output: bool = False
    record_offer: bool = False
    offered: object | None = None
    # Attention after q/k norms and RoPE: how a norm's output becomes q or k (``ModelLayout.
    # qk_norm_rotary``), and during a forward the call's ``(cos, sin, {slot: norm state})``
    # (:mod:`hf_actq.ops.rotary`).
    qk_norm_rotary: str | None = None
    rotary: tuple | None = None
    # Attention that gates its output by a sigmoid before its output projection (``ModelLayout.
    # gated_output_classes``), and during a forward the window its attention function opens
    # (:mod:`hf_actq.ops.gated_output`).
    gated_output: bool = False
    gate_window: object | None = None
    # Modules run again in backward from their packed input (ops/recomputed_mixer.py): the
    # module as the recompute swaps its trainable parameters in (a ``Reparametrized``).
    reparametrized: object | None = None

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLABLE)

    def __deepcopy__(self, memo) -> OpState:
        # What copy.deepcopy does by default, which __reduce_ex__ above would stop.
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def slot_id(self, slot: str) -> str:
        return f"{self.path}:{slot}"

    def pack(self, x: torch.Tensor, slot: str, linear_input: bool = False):
        """Pack ``x`` into ``slot`` with the slot's codec (through the shared cache).
        ``linear_input``: ``x`` is a linear layer's input, which sibling linears may share."""
        return self.cache.pack(x, self.codecs[slot], self.slot_id(slot), linear_input)


def default_state(plain, codec: Codec | None, cache: PackCache | None, slots, **extra) -> OpState:
    """A standalone op's state: ``codec`` (4-bit uniform rounding unless given) in each of
    ``slots``, and the shared cache unless given."""
    codec = codec if codec is not None else AverageQuantCodec(bits=4)
    return OpState(
        plain=plain,
        codecs=dict.fromkeys(slots, codec),
        cache=cache if cache is not None else DEFAULT_CACHE,
        **extra,
    )


def state_of(module: nn.Module) -> OpState:
    return module.__dict__[STATE]


def set_state(module: nn.Module, state: OpState) -> None:
    module.__dict__[STATE] = state


def remove_state(module: nn.Module) -> None:
    module.__dict__.pop(STATE, None)


def wants_backward(module: nn.Module | None, *tensors) -> bool:
    """Whether the op keeps compressed tensors for backward: ``module`` in training mode (or
    None: a standalone call), grad enabled and any tensor requiring grad. A gradient taken in
    eval mode (input saliency, an adversarial example) is the stock module's, exactly."""
    if module is not None and not module.training:
        return False
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


OBSERVER = "hf_actq_observer"


def observing(hook):
    """Mark ``hook`` as one that only watches (hf_actq's memory meter): a fused op may skip it,
    since it changes nothing the op computes (a partial, so that it can carry the mark)."""
    hook = functools.partial(hook)
    setattr(hook, OBSERVER, True)
    return hook


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks (a user's, ``torch.nn.utils.prune``'s)
    that a fused op reading its weights without calling it would skip. Not counted: hf_actq's
    observers, and DeepSpeed ZeRO-3's, which only gather and release the module's parameters
    (hung on every module): ZeRO-3 gathers what a fused op reads with the op's own module
    (:func:`hf_actq.integrations.patching.gather_with_module`, and a parameter read in a forward
    the engine runs)."""
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    )
    return any(not _skippable(hook) for table in hooks for hook in table.values())


def _skippable(hook) -> bool:
    if getattr(hook, OBSERVER, False):
        return True
    function = getattr(hook, "__func__", getattr(hook, "func", hook))
    origin = getattr(function, "__module__", None) or type(hook).__module__
    return origin.startswith("deepspeed.")


def keep_rng_stream(module: nn.Module | None, *codecs) -> None:
    """For a forward that keeps nothing: in training mode, draw the seeds packing would draw
    (none when per-slot seeds replace the draws, as in the adaptive pass)."""
    if module is not None and module.training and not per_slot_seeds():
        skip_seeds(*codecs)


TWICE = b"trying to differentiate twice a function that was marked with @once_differentiable"


def once_differentiable(backward):
    """torch's ``once_differentiable``, strict: under ``create_graph`` every gradient the
    backward returns raises torch's "differentiate twice" error when differentiated. torch's own
    returns plain constants when the incoming gradient needs none (the first op of a backward: a
    loss), so a second-order term, a gradient penalty, silently lost that op's part."""

    @functools.wraps(backward)
    def wrapper(ctx, *args):
        # Autograd runs a backward with grad enabled only under create_graph: otherwise no
        # no_grad block (a few µs of host time per op, every op of every step).
        if not torch.is_grad_enabled():
            return backward(ctx, *args)
        with torch.no_grad():
            outputs = backward(ctx, *args)
        return refuse_differentiation(outputs)

    return wrapper


def refuse_differentiation(outputs):
    """``outputs`` (a tensor or a tuple, Nones kept) as tensors whose differentiation raises."""
    single = not isinstance(outputs, tuple)
    outputs = (outputs,) if single else outputs
    error = _functions.DelayedError(TWICE, len(outputs))
    # DelayedError needs an input that requires grad to give its outputs a grad_fn.
    aliases = [None if t is None else t.detach().requires_grad_() for t in outputs]
    refused = error(*aliases)
    refused = refused if isinstance(refused, tuple) else (refused,)
    return refused[0] if single else refused


def packs_in_kernel(x: torch.Tensor, codecs) -> bool:
    """Whether a fused kernel may make the packs of tensors shaped as ``x`` itself, with the
    seeds and shares the pack cache would give: uniform/AQ ``codecs`` whose groups divide the
    last dim, kernels that run for ``x`` (CPU: the twin would be the composition), no observer
    watching the packs (measurement and calibration see every tensor packed), no trace, and no
    stochastic codec while a CUDA graph is captured (the fused kernels take their seeds from
    the host, which a graph would freeze; the packs' own kernels read them on the device)."""
    return (
        all(isinstance(codec, AverageQuantCodec) for codec in codecs)
        and not any(x.shape[-1] % codec.group_size for codec in codecs)
        and runs_kernels(x)
        and observer() is None
        and not torch.compiler.is_compiling()
        and not (any(codec.stochastic for codec in codecs) and capturing_cuda_graph(x.device))
    )


def kernel_reads(packed: Packed, like: torch.Tensor) -> bool:
    """Whether a kernel can read ``packed`` in place of a tensor like ``like``: a plain
    uniform/AQ pack in ``like``'s dtype whose groups divide the last dim, holding its codes,
    minimums and scales (a traced pack holds their one allocation: codecs/library.py)."""
    return (
        type(packed) is Packed
        and isinstance(packed.codec, AverageQuantCodec)
        and len(packed.tensors) == 3
        and packed.dtype == like.dtype
        and not packed.shape[-1] % packed.codec.group_size
    )
