"""Patching the per-module slots of a model: linear layers (and GPT-2's Conv1D), LayerNorm and
LLaMA-form RMSNorm, dropout, pointwise activations and gated MLPs.

Each patch binds the ``forward`` of the matching op class in ``hf_actq.ops`` onto the module
instance (see :mod:`hf_actq.integrations.patching`), so patched models and standalone ops share
one implementation.
"""

from __future__ import annotations

from torch import nn

from hf_actq.codecs.packed import ExactCodec
from hf_actq.config import ActQConfig
from hf_actq.fewbit.activations import activation_of
from hf_actq.integrations.patching import bind_forward
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import CompressedDropout
from hf_actq.ops.fewbit_activation import ActivationTable, FewBitActivation
from hf_actq.ops.gated_mlp import (
    CompressedFusedGatedMLP,
    CompressedGatedMLP,
    is_fused_gated_mlp,
    plain_projections,
)
from hf_actq.ops.linear import CompressedConv1D, CompressedLinear
from hf_actq.ops.norm import (
    CompressedLayerNorm,
    CompressedRMSNorm,
    computes_llama_rms_norm,
    rms_norm_eps,
)
from hf_actq.ops.state import OpState

# torch's tanh and sigmoid keep their *output*, which the next layer usually keeps anyway (BERT's
# pooler): a few-bit copy would add bytes rather than save them.
_OUTPUT_SAVING = ("tanh", "sigmoid")


def patch_layers(model: nn.Module, config: ActQConfig, handle) -> None:
    cache = PackCache()
    codec = config.make_codec()
    claimed: set[int] = set()

    def bind(module, op_forward, path, description, **state):
        state = OpState(cache=cache, **state)
        return bind_forward(module, op_forward, state, path, description, handle)

    for path, module in model.named_modules():
        if id(module) in claimed:
            continue
        if config.skips(path):
            claimed.update(id(m) for m in module.modules())
            handle.skipped[path] = "skip_modules"
            continue
        gated = _gated_activation(module)
        if gated is not None and config.gated_mlp:
            act = _activation(gated, config)
            fused = plain_projections(module)
            how = "operands" if fused else "product (projections patched as their own modules)"
            description = f"gated_mlp {act.spec.name} {act.bits}-bit few-bit; {how} {codec!r}"
            if bind(
                module,
                CompressedGatedMLP.forward,
                path,
                description,
                codec=codec,
                activation=act,
                fused_projections=fused,
            ):
                # With plain projections the MLP runs them itself; wrapped ones (PEFT before
                # hf_actq) run as modules and are patched one by one.
                claimed.update(id(m) for m in (module.modules() if fused else (module.act_fn,)))
            continue
        fused_act = _fused_gated_activation(module)
        if fused_act is not None and (config.gated_mlp or config.activations):
            # The activation's input is a view of the fused gate/up output, which the product
            # keeps alive anyway: only the fused op can drop it. Without gated_mlp its operands
            # stay exact (compacted).
            act = _activation(fused_act, config)
            operands = codec if config.gated_mlp else ExactCodec()
            description = f"gated_mlp {act.spec.name} {act.bits}-bit few-bit; operands {operands!r}"
            bind(
                module,
                CompressedFusedGatedMLP.forward,
                path,
                description,
                codec=operands,
                activation=act,
                linear_codec=codec if config.linear else None,
            )
            claimed.update(id(m) for m in module.modules())
            continue
        found = activation_of(module) if config.activations else None
        if found is not None:
            if found[0] in _OUTPUT_SAVING:
                handle.skipped[path] = f"{found[0]} keeps its output, which the next layer keeps"
                continue
            act = _activation(found, config)
            description = f"activation {act.describe()}"
            bind(module, FewBitActivation.forward, path, description, activation=act)
        elif type(module) is nn.Linear and config.linear:
            bind(module, CompressedLinear.forward, path, f"linear {codec!r}", codec=codec)
        elif config.linear and _is_conv1d(module):
            description = f"linear (Conv1D) {codec!r}"
            bind(module, CompressedConv1D.forward, path, description, codec=codec)
        elif type(module) is nn.LayerNorm and config.norm and len(module.normalized_shape) == 1:
            bind(module, CompressedLayerNorm.forward, path, f"norm {codec!r}", codec=codec)
        elif config.norm and type(module).__name__.endswith("RMSNorm"):
            if computes_llama_rms_norm(module):
                eps = rms_norm_eps(module)
                bind(
                    module, CompressedRMSNorm.forward, path, f"norm {codec!r}", codec=codec, eps=eps
                )
            else:
                handle.skipped[path] = "RMSNorm with a different formula (kept exact)"
        elif type(module) is nn.Dropout and config.dropout:
            mode = config.dropout_mode
            bind(module, CompressedDropout.forward, path, f"dropout ({mode})", dropout_mode=mode)


def _activation(found: tuple[str, dict], config: ActQConfig) -> ActivationTable:
    return ActivationTable(found[0], config.activation_bits, found[1])


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
