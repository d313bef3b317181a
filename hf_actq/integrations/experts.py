"""Patching mixture-of-experts experts: the compressed experts function is registered with
transformers' ``ExpertsInterface`` and the experts modules' configs are pointed at it, as
attention is patched through ``AttentionInterface``. Found by structure in any model (every
experts class transformers decorates with ``use_experts_implementation``)."""

from __future__ import annotations

import functools

from torch import nn

from hf_actq.codecs.packed import ExactCodec
from hf_actq.config import ActQConfig
from hf_actq.fewbit.activations import activation_of
from hf_actq.integrations.patching import left_to_foreign_forward
from hf_actq.integrations.slots import slot_activation, slot_codec
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.moe_experts import SLOTS, register_experts, supports_experts
from hf_actq.ops.moe_experts_recomputed import supports_recomputed_gate
from hf_actq.ops.state import OpState, remove_state, set_state

# Implementations the compressed op may stand in for: transformers' own CPU/GPU paths (their
# grouped matmuls are what the op runs). Vendor kernels (deepgemm, sonicmoe) stay as chosen.
_REPLACEABLE = (None, "eager", "grouped_mm", "batched_mm")


def patch_experts(
    model: nn.Module, config: ActQConfig, handle, cache: PackCache | None = None
) -> dict[nn.Module, str]:
    """Compress the experts of every MoE block: with ``gated_mlp`` the product's operands take
    the config's codec, with only ``activations`` they stay exact (the few-bit code still replaces
    the activation's input, and the product and down output are rebuilt in backward); with
    ``linear`` the input, where the experts' weights train, is packed as a linear layer's
    (``cache``: the one the router's linear packs the same tensor into). Returns the modules
    the op computes itself (the experts' activations), for the other patches to leave alone."""
    claimed: dict[nn.Module, str] = {}
    if not (config.gated_mlp or config.activations):
        return claimed
    codec = config.make_codec() if config.gated_mlp else ExactCodec()
    configs = {}
    wrappers = param_wrappers(model)
    for path, module in model.named_modules():
        if not _is_experts(module) or config.skips(path):
            continue
        if left_to_foreign_forward(module, path, handle):
            continue
        previous = module.config._experts_implementation
        found = activation_of(getattr(module, "act_fn", None))
        few_bit = supports_experts(module) and found is not None
        if not (few_bit or supports_recomputed_gate(module)):
            handle.skipped[path] = (
                "experts with a post-expert norm, expert parallelism or parameters besides "
                "their projections (kept as they are)"
            )
            continue
        if previous not in _REPLACEABLE:
            handle.skipped[path] = f"{previous!r} experts implementation (kept)"
            continue
        state = OpState(
            path=path,
            experts_fallback=previous,
            cache=cache if cache is not None else PackCache(),
            lora_wrappers=wrappers.get(id(module), {}),
        )
        if few_bit:
            state.activation = slot_activation(found, config, state.slot_id("act"))
            slots = {"act": "activation", "gate": "mlp", "up": "mlp"}
        else:
            # Another layout or gate: the projection's output kept, the gate recomputed.
            slots = {"gate_up": "mlp"}
        for slot in slots:
            if slot != "act":
                state.codecs[slot] = slot_codec(config, state.slot_id(slot), codec)
        if config.linear:
            slots["input"] = "linear"
            state.codecs["input"] = slot_codec(config, state.slot_id("input"), config.make_codec())
        describe = functools.partial(_describe, state)
        handle.record(path, describe, undo=functools.partial(remove_state, module))
        set_state(module, state)
        handle.add_slots(state, slots)
        configs.setdefault(id(module.config), module.config)
        if isinstance(getattr(module, "act_fn", None), nn.Module):
            claimed[module.act_fn] = "the MoE experts op computes it"
    if not configs:
        return claimed
    name = register_experts()
    for experts_config in configs.values():
        handle.record(
            undo=functools.partial(
                setattr,
                experts_config,
                "_experts_implementation",
                experts_config._experts_implementation,
            )
        )
        experts_config._experts_implementation = name
    return claimed


def param_wrappers(model: nn.Module) -> dict[int, dict[str, nn.Module]]:
    """PEFT's ``ParamWrapper`` (LoRA on a parameter) of each wrapped parameter name, by the id
    of the module that holds the parameter: the experts ops make the adapter's factors again
    from it in backward (``moe_routing.refolded``), and the routers their folded weight
    (``moe_router``), instead of keeping PEFT's copies."""
    found: dict[int, dict[str, nn.Module]] = {}
    for module in model.modules():
        if type(module).__name__ == "ParamWrapper" and hasattr(module, "get_delta_factors"):
            found.setdefault(id(module.get_base_layer()), {})[module.parameter_name] = module
    return found


def _is_experts(module) -> bool:
    """An experts module of transformers' ``use_experts_implementation`` (whose ``__init__``
    sets these flags; 5.17 does not set the newer ``_is_expert_parallel``)."""
    return all(hasattr(module, n) for n in ("has_gate", "is_transposed", "is_concatenated"))


def _describe(state: OpState) -> str:
    given = ""
    if "input" in state.codecs:
        given = f"; input={state.codecs['input']!r} (where the experts train)"
    if state.activation is None:
        gate_up = state.codecs["gate_up"]
        return f"moe_experts, gate recomputed in backward; gate_up={gate_up!r}{given}"
    operands = ", ".join(f"{slot}={state.codecs[slot]!r}" for slot in SLOTS if slot != "act")
    return f"moe_experts {state.activation.describe()}; {operands}{given}"
