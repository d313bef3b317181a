"""Patching the per-module slots of a model: linear layers (and GPT-2's Conv1D), LayerNorm and
RMSNorm in LLaMA's or Gemma's form, dropout, pointwise activations and gated MLPs.

``RULES`` is the table: each rule recognises one kind of module and says which op's forward it
gets, with which slots and description (a :class:`Patch`), or why it stays as it is (a
:class:`Skip`). A new kind of module is one rule.

Each patch binds the ``forward`` of the matching op class in ``hf_actq.ops`` onto the module
instance (see :mod:`hf_actq.integrations.patching`), so patched models and standalone ops share
one implementation. Each slot takes the config's codec unless a per-slot setting
(``ActQConfig.slots``) names another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_actq.codecs.packed import Codec, ExactCodec
from hf_actq.config import ActQConfig
from hf_actq.fewbit.activations import activation_of, activation_subclass
from hf_actq.integrations.experts import param_wrappers
from hf_actq.integrations.patching import (
    bind_forward,
    foreign_forward,
    gather_with_module,
    set_instance_attribute,
    uncalled_children,
)
from hf_actq.integrations.slots import slot_activation, slot_codec
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import CompressedDropout
from hf_actq.ops.fewbit_activation import FewBitActivation
from hf_actq.ops.gated_mlp import (
    CompressedFusedGatedMLP,
    CompressedGatedMLP,
    CompressedT5GatedMLP,
    is_fused_gated_mlp,
    plain_projections,
    t5_gated_activation,
)
from hf_actq.ops.linear import CompressedConv1D, CompressedLinear
from hf_actq.ops.moe_router import compressed_router_forward, is_router
from hf_actq.ops.norm import (
    CompressedLayerNorm,
    CompressedRMSNorm,
    rms_norm_eps,
    rms_norm_form,
    shares_output,
)
from hf_actq.ops.packed_checkpoint import Reparametrized
from hf_actq.ops.recomputed_mixer import is_recomputed_mixer, recomputed_mixer_forward
from hf_actq.ops.state import STATE, OpState, state_of

# torch's ReLU, tanh and sigmoid keep their *output*. ReLU's 1-bit code is exact, so it replaces
# that output wherever nothing else keeps it: where the next linear keeps a compressed copy, but
# not where the next op keeps the output itself (an uncompressed linear, the product of a gated
# MLP left stock), since there a code would add bytes. tanh and sigmoid stay exact: their few-bit
# derivatives are approximate, and where they appear (BERT's pooler, gates) the next layer
# usually keeps the output anyway.
_OUTPUT_SAVING = ("relu", "tanh", "sigmoid")


def _never_called(model: nn.Module) -> dict[nn.Module, str]:
    """Modules their owner never calls; patched, they would be slots that never fill. Linear
    modules whose weights an owner reads directly: PEFT's ``ParamWrapper`` (LoRA on a parameter,
    ``target_parameters``) adds ``lora_B @ lora_A`` to the wrapped weight. Children that a
    forward set on their parent's instance does not name (Liger-Kernel's SwiGLU computes the
    MLP's activation in its own kernel), with everything inside them."""
    found = {}
    for module in model.modules():
        if type(module).__name__ == "ParamWrapper" and hasattr(module, "lora_A"):
            for child in (*module.lora_A.values(), *module.lora_B.values()):
                found[child] = "PEFT's ParamWrapper reads this weight directly (never called)"
        for name in uncalled_children(module):
            reason = f"not called by its parent's forward, {foreign_forward(module)}"
            found.update(dict.fromkeys(module._modules[name].modules(), reason))
    return found


def _lora_layers(model: nn.Module):
    """PEFT's LoRA layers that call their adapters as modules on a cast of their input."""
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if (
            isinstance(lora_a, nn.ModuleDict)
            and hasattr(type(module), "_cast_input_dtype")
            and type(module).__name__ != "ParamWrapper"
        ):
            yield module


def _share_lora_inputs(model: nn.Module, cache: PackCache, handle) -> None:
    """Under PEFT's fp32 adapters on a half-precision model, each LoRA layer casts its input for
    each adapter, and ``lora_dropout`` makes a new tensor of it: every ``lora_A`` would pack its
    own fp32 copy (q, k and v three of one input), none of them the norm's offered output. Both
    steps are told to the pack cache instead (:meth:`PackCache.alias`), so ``lora_A`` keeps
    the input in its own dtype, shared, and rebuilds the cast and the dropout from it."""
    for layer in _lora_layers(model):
        cast = functools.partial(cast_input_sharing_pack, layer, cache)
        set_instance_attribute(layer, "_cast_input_dtype", cast, handle)
        for dropout in getattr(layer, "lora_dropout", {}).values():
            if STATE in dropout.__dict__:
                state_of(dropout).offer_output = True


def _share_t5_products(model: nn.Module) -> None:
    """A T5 gated MLP feeds wo the dropout of its product: that dropout tells the pack cache
    (as PEFT's lora_dropout does), so wo rebuilds its input from the product's packed operands
    and the dropout's seed instead of packing the intermediate-size tensor again."""
    for module in model.modules():
        mlp = module.__dict__.get(STATE)
        dropout = getattr(module, "dropout", None)
        if (
            mlp is not None
            and mlp.offer_output
            and t5_gated_activation(module) is not None
            and isinstance(dropout, nn.Module)
            and STATE in dropout.__dict__
        ):
            state_of(dropout).offer_output = True


def cast_input_sharing_pack(layer: nn.Module, cache: PackCache, x, dtype):
    """PEFT's ``_cast_input_dtype``, telling ``cache`` that the cast is ``x``'s."""
    cast = type(layer)._cast_input_dtype(layer, x, dtype)
    if cast is not x and isinstance(x, torch.Tensor) and torch.is_grad_enabled():
        cache.alias(cast, x)
    return cast


@dataclass
class Walk:
    """What the rules share while ``patch_layers`` walks one model."""

    config: ActQConfig
    codec: Codec | None  # the config's
    # PEFT's ParamWrappers by the id of the module holding the parameter (experts.param_wrappers).
    lora_wrappers: dict = field(default_factory=dict)
    # act_fn of gated MLPs whose product runs stock (the product keeps act(gate) itself).
    stock_products: set[int] = field(default_factory=set)


@dataclass
class Patch:
    """What a rule makes of a module: the op to bind, its slots (slot -> kind; codec slots and
    the few-bit "act" slot), how ``handle.patched`` shows it, and the modules it covers."""

    forward: Callable
    kinds: dict[str, str]
    describe: str  # a template: {act} the activation, {slot} a slot's codec
    fields: dict = field(default_factory=dict)  # OpState fields
    activation: tuple | None = None  # (name, params) for the "act" slot
    codecs: dict | None = None  # per-slot defaults in place of the config's codec
    claims: tuple = ()  # modules the op runs itself, left alone once it is bound
    leaves_alone: tuple = ()  # modules left alone whether or not it binds
    # The op reads its submodules' weights without calling them: an engine that gathers each
    # module's own parameters in a forward hook must gather these with the module.
    reads_child_weights: bool = False


@dataclass
class Skip:
    """A module a rule recognises and leaves alone, with the reason (``handle.skipped``)."""

    reason: str


def _recomputed_mixer(module, walk: Walk) -> Patch | None:
    if not walk.config.attention or not is_recomputed_mixer(module):
        return None
    # Its projections, convolution and norm run stock inside it, in both passes (under
    # DeepSpeed ZeRO-3, with their own gathers, the mixer runs stock: see the op).
    return Patch(
        recomputed_mixer_forward,
        {"input": "attention"},
        "linear attention: its input {input}, the mixer run again in backward",
        fields={"reparametrized": Reparametrized(module)},
        claims=tuple(module.modules()),
    )


def _gated_mlp(module, walk: Walk) -> Patch | None:
    gated = _gated_activation(module)
    if gated is None:
        return None
    if not walk.config.gated_mlp:
        walk.stock_products.add(id(module.act_fn))
        return None
    fused = plain_projections(module)
    how = "operands" if fused else "product (projections patched as their own modules)"
    # With plain projections the MLP runs them itself; wrapped ones (PEFT before hf_actq) run
    # as modules and are patched one by one, and the "input" slot stays empty (x is packed by
    # the projections themselves).
    return Patch(
        CompressedGatedMLP.forward,
        {"input": "mlp", "act": "activation", "gate": "mlp", "up": "mlp"},
        f"gated_mlp {{act}}; {how} {{gate}}",
        # Offered to a down projection run as its own module (PEFT LoRA's lora_A).
        fields={
            "fused_projections": fused,
            "act_module": module.act_fn,
            "offer_output": walk.config.share_norm_outputs,
        },
        activation=gated,
        claims=tuple(module.modules()) if fused else (module.act_fn,),
        reads_child_weights=fused,
    )


def _t5_gated_mlp(module, walk: Walk) -> Patch | None:
    gated = t5_gated_activation(module)
    if gated is None:
        return None
    if not walk.config.gated_mlp:
        walk.stock_products.add(id(module.act))
        return None
    # Only the product is fused; the projections, dropout and wo are patched as their own
    # modules.
    return Patch(
        CompressedT5GatedMLP.forward,
        {"act": "activation", "gate": "mlp", "up": "mlp"},
        "gated_mlp {act}; product {gate}",
        # The product is offered to wo through the MLP's dropout (_share_t5_products).
        fields={"act_module": module.act, "offer_output": walk.config.share_norm_outputs},
        activation=gated,
        claims=(module.act,),
    )


def _fused_gated_mlp(module, walk: Walk) -> Patch | None:
    config = walk.config
    found = _fused_gated_activation(module)
    if found is None or not (config.gated_mlp or config.activations):
        return None
    # The activation's input is a view of the fused gate/up output, which the product keeps
    # alive anyway: only the fused op can drop it, so its parts are never patched on their
    # own. Without gated_mlp its operands stay exact (compacted).
    operands = walk.codec if config.gated_mlp else ExactCodec()
    kinds = {"act": "activation", "gate": "mlp", "up": "mlp"}
    return Patch(
        CompressedFusedGatedMLP.forward,
        {"input": "mlp", **kinds} if config.linear else kinds,
        "gated_mlp {act}; operands {gate}",
        fields={"act_module": module.activation_fn},
        activation=found,
        codecs={"input": walk.codec, "gate": operands, "up": operands},
        leaves_alone=tuple(module.modules()),
        reads_child_weights=True,
    )


def _activation(module, walk: Walk) -> Patch | Skip | None:
    config = walk.config
    found = activation_of(module) if config.activations else None
    if found is None:
        subclassed = activation_subclass(module) if config.activations else None
        if subclassed is not None:
            return Skip(f"a subclass of {subclassed} with a forward of its own (kept stock)")
        return None
    shared = not config.linear or id(module) in walk.stock_products or found[0] != "relu"
    if found[0] in _OUTPUT_SAVING and shared:
        return Skip(
            f"{found[0]} keeps its output, which the next op keeps exactly too "
            "(a few-bit copy would add bytes)"
        )
    return Patch(
        FewBitActivation.forward,
        {"act": "activation"},
        "activation {act}",
        fields={"act_codec": found[0] not in _OUTPUT_SAVING},
        activation=found,
    )


def _linear(module, walk: Walk) -> Patch | None:
    if not walk.config.linear:
        return None
    if type(module) is nn.Linear:
        return Patch(CompressedLinear.forward, {"input": "linear"}, "linear {input}")
    if _is_conv1d(module):
        return Patch(CompressedConv1D.forward, {"input": "linear"}, "linear (Conv1D) {input}")
    return None


def _router(module, walk: Walk) -> Patch | None:
    if not walk.config.linear or not is_router(module):
        return None
    describe = "MoE router: its linear's input {input} where it trains; softmax and top-k exact"
    fields = {"lora_wrappers": walk.lora_wrappers.get(id(module), {})}
    return Patch(compressed_router_forward, {"input": "linear"}, describe, fields=fields)


def _norm_patch(forward, config: ActQConfig, module, offset=0.0, **fields) -> Patch | Skip:
    """A norm compressed (``norm``), or exact but keeping its output (memory sharing)."""
    if config.norm:
        fields["offer_output"] = config.share_norm_outputs
        return Patch(forward, {"input": "norm"}, "norm {input}", fields=fields)
    if not shares_output(getattr(module, "weight", None), offset):
        return Skip("norm whose weight has more zeros than guard columns (kept exact)")
    fields["norm_from_output"] = True
    describe = "norm (exact; keeps its output, shared with the next layer)"
    return Patch(forward, {}, describe, fields=fields)


def _norm(module, walk: Walk) -> Patch | Skip | None:
    config = walk.config
    if not (config.norm or config.share_norm_outputs):
        return None
    if type(module) is nn.LayerNorm and len(module.normalized_shape) == 1:
        return _norm_patch(CompressedLayerNorm.forward, config, module)
    if type(module).__name__.endswith(("RMSNorm", "T5LayerNorm")):
        form = rms_norm_form(module)
        if form is None:
            return Skip("RMSNorm with a different formula (kept exact)")
        offset, fp32_scale = form
        return _norm_patch(
            CompressedRMSNorm.forward,
            config,
            module,
            offset,
            eps=rms_norm_eps(module),
            norm_offset=offset,
            norm_fp32_scale=fp32_scale,
            norm_forms=_norm_forms(module, form),
        )
    return None


def _norm_forms(module, form) -> dict:
    """The forms an RMSNorm is known to compute, by (input dtype, weight dtype): a scale-free
    one's (no weight) checked now in each float dtype, so that no check runs inside a
    torch.compile trace (the weight's dtype tells a weighted one's first input dtype)."""
    weight = getattr(module, "weight", None)
    if weight is not None:
        return {(weight.dtype, weight.dtype): form}
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return {(dtype, None): rms_norm_form(module, dtype) for dtype in floats}


def _dropout(module, walk: Walk) -> Patch | None:
    if type(module) is not nn.Dropout or not walk.config.dropout:
        return None
    mode = walk.config.dropout_mode
    return Patch(CompressedDropout.forward, {}, f"dropout ({mode})", fields={"dropout_mode": mode})


# The rules, tried in order on every module: the first that recognises a module (a Patch or a
# Skip) decides it. Recomputed mixers and gated MLPs come first, since they run their
# projections (and activation) themselves; a model's own modules are matched by type or by the
# form of their forward.
RULES: tuple[Callable[[nn.Module, Walk], Patch | Skip | None], ...] = (
    _recomputed_mixer,
    _gated_mlp,
    _t5_gated_mlp,
    _fused_gated_mlp,
    _activation,
    _linear,
    _router,
    _norm,
    _dropout,
)


def patch_layers(
    model: nn.Module,
    config: ActQConfig,
    handle,
    exclude: dict[nn.Module, str] | None = None,
    cache: PackCache | None = None,
) -> None:
    """Patch every module a rule of ``RULES`` takes; ``exclude`` maps modules to leave alone to
    the reason (``handle.skipped`` shows it); ``cache``: the model's pack cache."""
    cache = cache if cache is not None else PackCache()
    walk = Walk(config, config.make_codec(), lora_wrappers=param_wrappers(model))
    exclude = {**(exclude or {}), **_never_called(model)}
    claimed: set[int] = {id(m) for m in exclude}
    for path, module in model.named_modules():
        if module in exclude:
            handle.skipped[path] = exclude[module]
        if id(module) in claimed:
            continue
        if config.skips(path):
            claimed.update(id(m) for m in module.modules())
            handle.skipped[path] = "skip_modules"
            continue
        for rule in RULES:
            found = rule(module, walk)
            if found is None:
                continue
            if isinstance(found, Skip):
                handle.skipped[path] = found.reason
                break
            if _bind(module, path, found, walk, cache, handle):
                claimed.update(id(m) for m in found.claims)
            claimed.update(id(m) for m in found.leaves_alone)
            break
    if config.linear:
        _share_lora_inputs(model, cache, handle)
        _share_t5_products(model)


def _bind(module, path: str, patch: Patch, walk: Walk, cache: PackCache, handle) -> bool:
    """Bind ``patch.forward`` with a state whose slots take ``patch.codecs`` (default: the
    config's codec) or their per-slot setting."""
    config = walk.config
    state = OpState(cache=cache, path=path, **patch.fields)
    for slot in patch.kinds:
        slot_id = state.slot_id(slot)
        if slot == "act":
            state.activation = slot_activation(patch.activation, config, slot_id)
            setting = config.setting_for(slot_id) or {}
            if "codec" in setting:
                if not state.act_codec:
                    raise ValueError(
                        f"slots[{slot_id!r}]: only a standalone activation can keep its "
                        "input with a codec; a gated MLP's activation keeps a few-bit code "
                        "({'bits': 1..4})"
                    )
                state.codecs["act"] = slot_codec(config, slot_id, None)
        else:
            default = walk.codec if patch.codecs is None else patch.codecs[slot]
            state.codecs[slot] = slot_codec(config, slot_id, default)
    describe = functools.partial(_describer(patch.describe), state)
    if bind_forward(module, patch.forward, state, path, describe, handle):
        handle.add_slots(state, patch.kinds)
        if patch.reads_child_weights:
            gather_with_module(module, handle)
        return True
    return False


def _describer(template: str):
    """A description of a state from ``template`` ({act}: the activation; {slot}: its codec)."""

    def describe(state: OpState) -> str:
        values = {slot: repr(codec) for slot, codec in state.codecs.items()}
        if state.activation is not None:
            values["act"] = state.activation.describe()
            if state.codecs.get("act") is not None:
                values["act"] = f"{state.activation.spec.name} input {state.codecs['act']!r}"
        return template.format(**values)

    return describe


def _gated_activation(module):
    """``(name, params)`` of a LLaMA-style gated MLP's activation, or None."""
    if not all(
        isinstance(getattr(module, name, None), nn.Module)
        for name in ("gate_proj", "up_proj", "down_proj")
    ):
        return None
    return activation_of(getattr(module, "act_fn", None))


def _fused_gated_activation(module):
    """``(name, params)`` of a Phi-3-style fused gated MLP's activation, or None."""
    if not is_fused_gated_mlp(module):
        return None
    return activation_of(getattr(module, "activation_fn", None))


def _is_conv1d(module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return type(module) is Conv1D
