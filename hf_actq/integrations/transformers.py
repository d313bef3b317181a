"""``hf_actq.apply(model, config) -> handle``: patch one model instance, reversibly.

Patching replaces ``forward`` on module *instances* (never on classes), keeps every parameter,
buffer and state-dict key as it was, and records each change so that ``handle.revert()``
restores the model exactly. ``print(model)`` shows each patched module with its codec.

``MODEL_TYPE_TO_APPLY_FN`` maps ``config.model_type`` to the function that patches that
architecture; any other model goes through :func:`apply_generic` with a warning.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hf_actq.codecs.packed import ExactCodec
from hf_actq.config import ActQConfig
from hf_actq.fewbit.activations import activation_of, get_activation, resolve_params
from hf_actq.fewbit.tables import table_for
from hf_actq.ops.attention import register_attention, register_sdpa_attention
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import CompressedDropoutFunction
from hf_actq.ops.fewbit_activation import FewBitActivationFunction
from hf_actq.ops.gated_mlp import GatedDownFunction
from hf_actq.ops.linear import CompressedLinearFunction
from hf_actq.ops.norm import CompressedLayerNormFunction, CompressedRMSNormFunction

logger = logging.getLogger("hf_actq")

_HANDLE = "_hf_actq_handle"
_STATE = "_hf_actq"


@dataclass
class ActQHandle:
    """What :func:`apply` changed; ``revert()`` undoes all of it."""

    model: nn.Module
    config: ActQConfig
    patched: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    _undo: list = field(default_factory=list, repr=False)

    def revert(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.patched.clear()
        if getattr(self.model, _HANDLE, None) is self:
            delattr(self.model, _HANDLE)

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for description in self.patched.values():
            kind = description.split(" ", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))


@dataclass
class _SlotState:
    codec: object
    cache: PackCache
    extra: dict = field(default_factory=dict)


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside DDP/FSDP/accelerate and PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
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
    base = unwrap(model)
    if getattr(base, _HANDLE, None) is not None:
        raise ValueError(
            "hf_actq is already applied to this model; call handle.revert() before applying again"
        )
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_FN.get(model_type)
    if apply_fn is None:
        apply_fn = apply_generic
    handle = ActQHandle(base, config)
    apply_fn(base, config, handle)
    if model_type not in MODEL_TYPE_TO_APPLY_FN:
        logger.warning(
            "hf_actq: model type %r has no registered patcher; the generic path patched %s",
            model_type,
            handle.summary() or "nothing",
        )
    setattr(base, _HANDLE, handle)
    return handle


def revert(model: nn.Module) -> None:
    """Undo :func:`apply` on ``model`` (no-op when it is not patched)."""
    handle = getattr(unwrap(model), _HANDLE, None)
    if handle is not None:
        handle.revert()


# Patchers -------------------------------------------------------------------------------------


def apply_generic(model: nn.Module, config: ActQConfig, handle: ActQHandle, attention=None):
    """Activation modules, nn.Linear and GPT-2's Conv1D, nn.LayerNorm, LLaMA-form *RMSNorm,
    gated MLPs and nn.Dropout; attention through ``attention`` ("eager" for the BERT layout,
    "sdpa" for decoders, None to leave it)."""
    cache = PackCache()
    codec = config.make_codec()
    claimed: set[int] = set()
    for path, module in model.named_modules():
        if id(module) in claimed:
            continue
        if config.skips(path):
            claimed.update(id(m) for m in module.modules())
            handle.skipped[path] = "skip_modules"
            continue
        if config.gated_mlp and _is_gated_mlp(module):
            claimed.update(_patch_gated_mlp(module, path, config, codec, cache, handle))
            continue
        if (config.gated_mlp or config.activations) and _is_fused_gated_mlp(module):
            # The activation's input is a view of the fused gate/up output, which the product
            # keeps alive anyway: only the fused op can drop it. Without gated_mlp its operands
            # stay exact (compacted).
            operands = codec if config.gated_mlp else ExactCodec()
            _patch_fused_gated_mlp(module, path, config, codec, operands, cache, handle)
            claimed.update(id(m) for m in module.modules())
            continue
        if config.activations and _patch_activation(module, path, config, handle):
            continue
        if type(module) is nn.Linear and config.linear:
            _patch(module, path, handle, _linear_forward, _SlotState(codec, cache), "linear")
        elif config.linear and _is_conv1d(module):
            state = _SlotState(codec, cache)
            _patch(module, path, handle, _conv1d_forward, state, "linear (Conv1D)")
        elif type(module) is nn.LayerNorm and config.norm and len(module.normalized_shape) == 1:
            _patch(module, path, handle, _layer_norm_forward, _SlotState(codec, cache), "norm")
        elif config.norm and type(module).__name__.endswith("RMSNorm"):
            _patch_rms_norm(module, path, codec, cache, handle)
        elif type(module) is nn.Dropout and config.dropout:
            state = _SlotState(None, cache, {"mode": config.dropout_mode})
            _patch(
                module, path, handle, _dropout_forward, state, f"dropout ({config.dropout_mode})"
            )
    if attention and config.attention:
        _patch_attention(model, config, codec, handle, attention)
    elif attention == "eager" and config.dropout and _attention_dropout(model) > 0:
        # Dropout compression covers attention-probability dropout too: eager attention keeps
        # the dropped probabilities and a byte-per-element mask besides the probabilities;
        # the op keeps q, k, v and the probabilities exact and the mask as an 8-byte seed.
        _patch_attention(model, config, None, handle, attention)


def _attention_dropout(model) -> float:
    model_config = getattr(model, "config", None)
    names = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
    return max((float(getattr(model_config, n, 0.0) or 0.0) for n in names), default=0.0)


def _patch(module, path, handle, forward, state, description):
    module.forward = types.MethodType(forward, module)
    setattr(module, _STATE, state)
    codec = state.codec
    shown = description + (f" {codec!r}" if codec is not None else "")
    base_repr = type(module).extra_repr

    def extra_repr(self=module):
        inner = base_repr(self)
        return f"{inner}, hf_actq={shown}" if inner else f"hf_actq={shown}"

    module.extra_repr = extra_repr
    handle.patched[path] = shown

    def undo():
        for name in ("forward", _STATE, "extra_repr", "_hf_actq_warned"):
            module.__dict__.pop(name, None)

    handle._undo.append(undo)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _compress(module, *tensors) -> bool:
    """Whether a patched module takes its compressed path.

    In training mode it always does, even under no_grad: reentrant checkpointing runs the first
    forward without grad, and the stochastic codecs must draw the same RNG seeds there as in the
    recompute and as an uncheckpointed run (the packed result is simply discarded)."""
    return module.training or _needs_grad(*tensors)


def _linear_forward(self, x):
    return _compressed_linear(self, x, self.weight)


def _is_conv1d(module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return type(module) is Conv1D


def _conv1d_forward(self, x):
    # GPT-2's Conv1D is a linear layer with a transposed [in, out] weight: x @ W + b.
    return _compressed_linear(self, x, self.weight.t())


def _compressed_linear(self, x, weight):
    if not _compress(self, x, weight, self.bias):
        return type(self).forward(self, x)
    state = getattr(self, _STATE)
    return CompressedLinearFunction.apply(x, weight, self.bias, state.codec, state.cache)


def _layer_norm_forward(self, x):
    if not _compress(self, x, self.weight, self.bias):
        return type(self).forward(self, x)
    state = getattr(self, _STATE)
    return CompressedLayerNormFunction.apply(
        x, self.weight, self.bias, self.eps, state.codec, state.cache
    )


def _rms_norm_forward(self, x):
    if not _compress(self, x, self.weight):
        return type(self).forward(self, x)
    state = getattr(self, _STATE)
    return CompressedRMSNormFunction.apply(
        x, self.weight, state.extra["eps"], state.codec, state.cache
    )


def _patch_rms_norm(module, path, codec, cache, handle):
    """Patch only RMSNorms that compute LLaMA's formula, checked bit for bit on a sample."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        handle.skipped[path] = "RMSNorm without weight/eps"
        return
    with torch.no_grad():
        # A private generator: patching must not move the global RNG (it would change, e.g.,
        # the initialisation of LoRA weights created afterwards).
        generator = torch.Generator(device=weight.device).manual_seed(0)
        sample = torch.randn(3, weight.shape[0], device=weight.device, generator=generator)
        sample = sample.to(weight.dtype)
        hidden = sample.float()
        ours = weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)).to(
            sample.dtype
        )
        if not torch.equal(module(sample), ours):
            handle.skipped[path] = "RMSNorm with a different formula (kept exact)"
            return
    state = _SlotState(codec, cache, {"eps": float(eps)})
    _patch(module, path, handle, _rms_norm_forward, state, "norm")


def _dropout_forward(self, x):
    if not self.training or self.p == 0.0:
        return x
    if self.p == 1.0:
        return F.dropout(x, self.p, True, self.inplace)
    return CompressedDropoutFunction.apply(x, float(self.p), getattr(self, _STATE).extra["mode"])


# Activations ----------------------------------------------------------------------------------

# torch's tanh and sigmoid keep their *output*, which the next layer usually keeps anyway (BERT's
# pooler): a few-bit copy would add bytes rather than save them.
_OUTPUT_SAVING = ("tanh", "sigmoid")


def _patch_activation(module, path, config, handle) -> bool:
    found = activation_of(module)
    if found is None:
        return False
    name, params = found
    if name in _OUTPUT_SAVING:
        handle.skipped[path] = f"{name} keeps its output, which the next layer keeps anyway"
        return True
    extra = _activation_extra(name, params, config)
    spec, table = extra["spec"], extra["table"]
    state = _SlotState(None, None, extra)
    kind = "exact" if spec.exact else f"error={table.error:.4f}"
    _patch(
        module,
        path,
        handle,
        _activation_forward,
        state,
        f"activation {name} {table.bits}-bit few-bit ({kind})",
    )
    return True


def _activation_extra(name, params, config) -> dict:
    """Spec, full parameters and table of a patched activation, plus a per-device tensor cache."""
    spec = get_activation(name)
    params = resolve_params(spec, params)
    table = table_for(name, config.activation_bits, **params)
    return {"spec": spec, "params": params, "table": table, "tensors": {}}


def _gated_down(state, gate, up, down):
    """``down(act(gate) * up)`` through the fused op, with the state's activation table; with
    ``down=None`` only the product."""
    borders, levels = _table_tensors(state, gate.device)
    spec, params = state.extra["spec"], state.extra["params"]
    return GatedDownFunction.apply(
        gate,
        up,
        None if down is None else down.weight,
        None if down is None else down.bias,
        (spec.name, tuple(params.values())),
        borders,
        levels,
        state.extra["table"].bits,
        state.codec,
        state.cache,
    )


def _table_tensors(state, device):
    tensors = state.extra["tensors"]
    if device not in tensors:
        table = state.extra["table"]
        tensors[device] = (
            torch.tensor(table.borders, dtype=torch.float32, device=device),
            torch.tensor(table.levels, dtype=torch.float32, device=device),
        )
    return tensors[device]


def _activation_forward(self, x):
    state = getattr(self, _STATE)
    spec, params = state.extra["spec"], state.extra["params"]
    if not _needs_grad(x) or not x.dtype.is_floating_point:
        return type(self).forward(self, x)
    borders, levels = _table_tensors(state, x.device)
    return FewBitActivationFunction.apply(
        x, spec.name, tuple(params.values()), borders, levels, state.extra["table"].bits
    )


# Gated MLP ------------------------------------------------------------------------------------


def _warn_replaced(module) -> None:
    if not getattr(module, "_hf_actq_warned", False):
        module._hf_actq_warned = True
        logger.warning(
            "hf_actq: a projection of %s was replaced after hf_actq.apply (e.g. by PEFT); the "
            "gated product stays compressed but the replaced projections' inputs are not. "
            "Apply hf_actq after get_peft_model for full coverage.",
            type(module).__name__,
        )


def _is_gated_mlp(module) -> bool:
    return (
        all(
            isinstance(getattr(module, name, None), nn.Module)
            for name in ("gate_proj", "up_proj", "down_proj")
        )
        and activation_of(getattr(module, "act_fn", None)) is not None
    )


def _plain_projections(module) -> bool:
    return all(type(getattr(module, n)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))


def _patch_gated_mlp(module, path, config, codec, cache, handle) -> set[int]:
    """Patches the MLP; returns the ids of the modules it now runs itself."""
    name, params = activation_of(module.act_fn)
    extra = _activation_extra(name, params, config)
    extra["fused"] = _plain_projections(module)
    how = "operands" if extra["fused"] else "product (projections patched as their own modules)"
    _patch(
        module,
        path,
        handle,
        _gated_mlp_forward,
        _SlotState(codec, cache, extra),
        f"gated_mlp {name} {extra['table'].bits}-bit few-bit; {how}",
    )
    if extra["fused"]:
        return {id(m) for m in module.modules()}
    # LoRA-wrapped projections (PEFT before hf_actq) run as modules, patched one by one.
    return {id(module), id(module.act_fn)}


def _gated_mlp_forward(self, x):
    gate_proj, up_proj, down = self.gate_proj, self.up_proj, self.down_proj
    state = getattr(self, _STATE)
    if not _plain_projections(self):
        if state.extra["fused"]:
            _warn_replaced(self)  # PEFT wrapped a projection after apply
        if not _compress(self, x, *self.parameters()):
            return type(self).forward(self, x)
        product = _gated_down(state, gate_proj(x), up_proj(x), None)
        return down(product)
    if not _compress(self, x, gate_proj.weight, up_proj.weight, down.weight):
        return type(self).forward(self, x)
    codec, cache = state.codec, state.cache
    # gate and up share one packed x through the cache; a frozen weight keeps nothing.
    gate = CompressedLinearFunction.apply(x, gate_proj.weight, gate_proj.bias, codec, cache)
    up = CompressedLinearFunction.apply(x, up_proj.weight, up_proj.bias, codec, cache)
    return _gated_down(state, gate, up, down)


def _is_fused_gated_mlp(module) -> bool:
    return (
        type(getattr(module, "gate_up_proj", None)) is nn.Linear
        and type(getattr(module, "down_proj", None)) is nn.Linear
        and activation_of(getattr(module, "activation_fn", None)) is not None
    )


def _patch_fused_gated_mlp(module, path, config, codec, operands, cache, handle):
    name, params = activation_of(module.activation_fn)
    extra = _activation_extra(name, params, config)
    extra["linear"] = codec if config.linear else None
    _patch(
        module,
        path,
        handle,
        _fused_gated_mlp_forward,
        _SlotState(operands, cache, extra),
        f"gated_mlp {name} {extra['table'].bits}-bit few-bit; operands",
    )


def _fused_gated_mlp_forward(self, x):
    """Phi-3's ``down(up * act(gate))`` with ``gate, up = gate_up_proj(x).chunk(2, -1)``."""
    fused, down = self.gate_up_proj, self.down_proj
    if not (type(fused) is nn.Linear and type(down) is nn.Linear):
        _warn_replaced(self)
        return type(self).forward(self, x)
    if not _compress(self, x, fused.weight, down.weight):
        return type(self).forward(self, x)
    state = getattr(self, _STATE)
    linear_codec = state.extra["linear"]
    if linear_codec is not None:
        gate_up = CompressedLinearFunction.apply(
            x, fused.weight, fused.bias, linear_codec, state.cache
        )
    else:
        gate_up = F.linear(x, fused.weight, fused.bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return _gated_down(state, gate, up, down)


# Attention ------------------------------------------------------------------------------------


def _patch_attention(model, config, codec, handle, kind):
    model_config = getattr(model, "config", None)
    if model_config is None:
        return
    if kind == "sdpa" and getattr(model_config, "attn_logit_softcapping", None):
        handle.skipped["attention"] = "logit soft-capping needs eager attention (kept exact)"
        return
    if getattr(model_config, "reorder_and_upcast_attn", False):
        handle.skipped["attention"] = "GPT-2's reorder_and_upcast_attn path (kept exact)"
        return
    previous = model_config._attn_implementation
    if kind == "sdpa" and previous != "sdpa":
        handle.skipped["attention"] = f"{previous!r} attention (kept exact; sdpa is patched)"
        return
    if previous not in ("eager", "sdpa", None):
        handle.skipped["attention"] = f"{previous!r} attention (kept exact)"
        return
    name = register_attention() if kind == "eager" else register_sdpa_attention()
    slots = ("q", "k", "v", "probs") if kind == "eager" else ("q", "k", "v")
    codecs = dict.fromkeys(slots, codec)
    count = 0
    for path, module in model.named_modules():
        if config.skips(path) or not _is_attention(module):
            continue
        module.hf_actq_attention_codecs = codecs
        # Without grad in eval, the original implementation runs, so outputs stay identical.
        module.hf_actq_attention_fallback = previous
        what = repr(codec) if codec is not None else "exact operands, dropout mask as a seed"
        handle.patched[path] = f"attention ({kind}) {what}"
        for attribute in ("hf_actq_attention_codecs", "hf_actq_attention_fallback"):
            handle._undo.append(functools.partial(module.__dict__.pop, attribute, None))
        count += 1
    if count:
        model_config._attn_implementation = name

        def undo():
            model_config._attn_implementation = previous

        handle._undo.append(undo)


def _is_attention(module) -> bool:
    # The innermost *Attention module calls the attention function; BERT's BertAttention only
    # wraps BertSelfAttention and its output projection.
    def named_attention(m):
        return type(m).__name__.endswith("Attention")

    return named_attention(module) and not any(
        named_attention(child) for child in module.modules() if child is not module
    )


# Registry -------------------------------------------------------------------------------------

_EAGER_LAYOUT = ("bert", "roberta", "xlm-roberta", "electra", "distilbert", "gpt2", "gpt_neox")
_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2")
# DeBERTa's disentangled attention does not go through transformers' AttentionInterface: the
# other slots are patched, attention is kept exact.
_OWN_ATTENTION = ("deberta-v2",)

MODEL_TYPE_TO_APPLY_FN = {
    **{t: functools.partial(apply_generic, attention="eager") for t in _EAGER_LAYOUT},
    **{t: functools.partial(apply_generic, attention="sdpa") for t in _DECODERS},
    **{t: functools.partial(apply_generic, attention=None) for t in _OWN_ATTENTION},
}
