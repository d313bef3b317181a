"""Patching the per-module slots of a model: linear layers (and GPT-2's Conv1D), LayerNorm and
RMSNorm in LLaMA's or Gemma's form, dropout, pointwise activations and gated MLPs.

Each patch binds the ``forward`` of the matching op class in ``hf_actq.ops`` onto the module
instance (see :mod:`hf_actq.integrations.patching`), so patched models and standalone ops share
one implementation. Each slot takes the config's codec unless a per-slot setting
(``ActQConfig.slots``) names another.
"""

from __future__ import annotations

import functools

from torch import nn

from hf_actq.codecs.packed import ExactCodec
from hf_actq.config import ActQConfig
from hf_actq.fewbit.activations import activation_of
from hf_actq.integrations.patching import bind_forward
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
from hf_actq.ops.norm import (
    CompressedLayerNorm,
    CompressedRMSNorm,
    rms_norm_eps,
    rms_norm_offset,
)
from hf_actq.ops.state import OpState

# torch's ReLU, tanh and sigmoid keep their *output*. ReLU's 1-bit code is exact, so it replaces
# that output wherever nothing else keeps it: where the next linear keeps a compressed copy, but
# not where the next op keeps the output itself (an uncompressed linear, the product of a gated
# MLP left stock), since there a code would add bytes. tanh and sigmoid stay exact: their few-bit
# derivatives are approximate, and where they appear (BERT's pooler, gates) the next layer
# usually keeps the output anyway.
_OUTPUT_SAVING = ("relu", "tanh", "sigmoid")


def _never_called(model: nn.Module) -> dict[nn.Module, str]:
    """Linear modules whose weights an owner reads directly, never calling them: PEFT's
    ``ParamWrapper`` (LoRA on a parameter, ``target_parameters``) adds ``lora_B @ lora_A`` to
    the wrapped weight. Patched, they would be slots that never fill."""
    found = {}
    for module in model.modules():
        if type(module).__name__ == "ParamWrapper" and hasattr(module, "lora_A"):
            for child in (*module.lora_A.values(), *module.lora_B.values()):
                found[child] = "PEFT's ParamWrapper reads this weight directly (never called)"
    return found


def patch_layers(
    model: nn.Module, config: ActQConfig, handle, exclude: dict[nn.Module, str] | None = None
) -> None:
    """Patch every known module type; ``exclude`` maps modules to leave alone to the reason
    (``handle.skipped`` shows it)."""
    cache = PackCache()
    codec = config.make_codec()
    exclude = {**(exclude or {}), **_never_called(model)}
    claimed: set[int] = {id(m) for m in exclude}
    stock_products: set[int] = set()  # act_fn of gated MLPs whose product runs stock
    # Norms: compressed (``norm``), or exact ones that keep their output (memory sharing).
    norms = config.norm or config.share_norm_outputs
    if config.norm:
        norm_slots = ({"input": "norm"}, _describer("norm {input}"))
        norm_fields = {"offer_output": config.share_norm_outputs}
    else:
        describe = _describer("norm (exact; keeps its output, shared with the next layer)")
        norm_slots, norm_fields = ({}, describe), {"norm_from_output": True}

    def bind(module, op_forward, path, kinds, describe, codecs=None, activation=None, **fields):
        """Bind with a state whose codec slots (``kinds``: slot -> kind, codec slots and the
        few-bit "act" slot) take ``codecs`` (default: the config's codec) or their setting."""
        state = OpState(cache=cache, path=path, **fields)
        for slot in kinds:
            slot_id = state.slot_id(slot)
            if slot == "act":
                state.activation = slot_activation(activation, config, slot_id)
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
                default = codec if codecs is None else codecs[slot]
                state.codecs[slot] = slot_codec(config, slot_id, default)
        if bind_forward(
            module, op_forward, state, path, functools.partial(describe, state), handle
        ):
            handle.add_slots(state, kinds)
            return True
        return False

    for path, module in model.named_modules():
        if module in exclude:
            handle.skipped[path] = exclude[module]
        if id(module) in claimed:
            continue
        if config.skips(path):
            claimed.update(id(m) for m in module.modules())
            handle.skipped[path] = "skip_modules"
            continue
        gated = _gated_activation(module)
        if gated is not None and not config.gated_mlp:
            stock_products.add(id(module.act_fn))  # the product keeps act(gate) itself
        if gated is not None and config.gated_mlp:
            fused = plain_projections(module)
            how = "operands" if fused else "product (projections patched as their own modules)"
            # With wrapped projections x is packed by the projections themselves, and the
            # "input" slot stays empty.
            kinds = {"input": "mlp", "act": "activation", "gate": "mlp", "up": "mlp"}
            described = _describer(f"gated_mlp {{act}}; {how} {{gate}}")
            if bind(
                module,
                CompressedGatedMLP.forward,
                path,
                kinds,
                described,
                activation=gated,
                fused_projections=fused,
            ):
                # With plain projections the MLP runs them itself; wrapped ones (PEFT before
                # hf_actq) run as modules and are patched one by one.
                claimed.update(id(m) for m in (module.modules() if fused else (module.act_fn,)))
            continue
        t5_gated = t5_gated_activation(module)
        if t5_gated is not None and config.gated_mlp:
            # Only the product is fused; the projections, dropout and wo are patched as their
            # own modules below.
            kinds = {"act": "activation", "gate": "mlp", "up": "mlp"}
            described = _describer("gated_mlp {act}; product {gate}")
            if bind(
                module, CompressedT5GatedMLP.forward, path, kinds, described, activation=t5_gated
            ):
                claimed.add(id(module.act))
            continue
        if t5_gated is not None:
            stock_products.add(id(module.act))
        fused_act = _fused_gated_activation(module)
        if fused_act is not None and (config.gated_mlp or config.activations):
            # The activation's input is a view of the fused gate/up output, which the product
            # keeps alive anyway: only the fused op can drop it. Without gated_mlp its operands
            # stay exact (compacted).
            operands = codec if config.gated_mlp else ExactCodec()
            codecs = {"input": codec, "gate": operands, "up": operands}
            kinds = {"act": "activation", "gate": "mlp", "up": "mlp"}
            if config.linear:
                kinds = {"input": "mlp", **kinds}
            bind(
                module,
                CompressedFusedGatedMLP.forward,
                path,
                kinds,
                _describer("gated_mlp {act}; operands {gate}"),
                codecs=codecs,
                activation=fused_act,
            )
            claimed.update(id(m) for m in module.modules())
            continue
        found = activation_of(module) if config.activations else None
        if found is not None:
            shared = not config.linear or id(module) in stock_products or found[0] != "relu"
            if found[0] in _OUTPUT_SAVING and shared:
                handle.skipped[path] = (
                    f"{found[0]} keeps its output, which the next op keeps exactly too "
                    "(a few-bit copy would add bytes)"
                )
                continue
            kinds = {"act": "activation"}
            describe = _describer("activation {act}")
            bind(
                module, FewBitActivation.forward, path, kinds, describe, activation=found,
                act_codec=found[0] not in _OUTPUT_SAVING,
            )  # fmt: skip
        elif type(module) is nn.Linear and config.linear:
            describe = _describer("linear {input}")
            bind(module, CompressedLinear.forward, path, {"input": "linear"}, describe)
        elif config.linear and _is_conv1d(module):
            describe = _describer("linear (Conv1D) {input}")
            bind(module, CompressedConv1D.forward, path, {"input": "linear"}, describe)
        elif type(module) is nn.LayerNorm and norms and len(module.normalized_shape) == 1:
            bind(module, CompressedLayerNorm.forward, path, *norm_slots, **norm_fields)
        elif norms and type(module).__name__.endswith(("RMSNorm", "T5LayerNorm")):
            offset = rms_norm_offset(module)
            if offset is not None:
                eps = rms_norm_eps(module)
                bind(
                    module, CompressedRMSNorm.forward, path, *norm_slots, eps=eps,
                    norm_offset=offset, **norm_fields,
                )  # fmt: skip
            else:
                handle.skipped[path] = "RMSNorm with a different formula (kept exact)"
        elif type(module) is nn.Dropout and config.dropout:
            mode = config.dropout_mode
            describe = _describer(f"dropout ({mode})")
            bind(module, CompressedDropout.forward, path, {}, describe, dropout_mode=mode)


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
