"""Autograd Functions and modules that decide exactly what is saved for backward."""

from hf_actq.ops.dropout import CompressedDropout
from hf_actq.ops.fewbit_activation import (
    FewBitActivation,
    FewBitActivationFunction,
    FewBitCELU,
    FewBitELU,
    FewBitGELU,
    FewBitHardsigmoid,
    FewBitHardswish,
    FewBitHardtanh,
    FewBitLeakyReLU,
    FewBitMish,
    FewBitQuickGELU,
    FewBitReLU,
    FewBitReLU6,
    FewBitSELU,
    FewBitSigmoid,
    FewBitSiLU,
    FewBitSoftplus,
    FewBitTanh,
    fewbit_activation,
)
from hf_actq.ops.gated_mlp import CompressedFusedGatedMLP, CompressedGatedMLP
from hf_actq.ops.linear import CompressedConv1D, CompressedLinear
from hf_actq.ops.norm import CompressedLayerNorm, CompressedRMSNorm

__all__ = [
    "CompressedConv1D",
    "CompressedDropout",
    "CompressedFusedGatedMLP",
    "CompressedGatedMLP",
    "CompressedLayerNorm",
    "CompressedLinear",
    "CompressedRMSNorm",
    "FewBitActivation",
    "FewBitActivationFunction",
    "FewBitCELU",
    "FewBitELU",
    "FewBitGELU",
    "FewBitHardsigmoid",
    "FewBitHardswish",
    "FewBitHardtanh",
    "FewBitLeakyReLU",
    "FewBitMish",
    "FewBitQuickGELU",
    "FewBitReLU",
    "FewBitReLU6",
    "FewBitSELU",
    "FewBitSigmoid",
    "FewBitSiLU",
    "FewBitSoftplus",
    "FewBitTanh",
    "fewbit_activation",
]
