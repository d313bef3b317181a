"""The kernel ops, one file each: a PyTorch twin, a Triton kernel and its launcher, registered
through ``torch.library`` (``registry.py``). CUDA tensors run the Triton kernels where Triton is
installed; everything else runs the twins, which are also the tests' oracle.

Set ``HF_ACTQ_DISABLE_TRITON=1`` to force the twins on GPU too (debugging, bisecting).
"""

from hf_actq.kernels.average_quant import aq_dequantize, aq_quantize
from hf_actq.kernels.dropout import seeded_dropout
from hf_actq.kernels.fewbit import fewbit_backward, fewbit_forward
from hf_actq.kernels.gated_product import gated_backward, gated_forward
from hf_actq.kernels.mask import mask_pack, mask_unpack
from hf_actq.kernels.norm import (
    norm_backward,
    norm_backward_from_output,
    norm_backward_packed,
    norm_pack,
)
from hf_actq.kernels.packing import pack_codes, packed_nbytes, unpack_codes
from hf_actq.kernels.registry import FAILED, KERNELS, kernels_on_cpu, triton_available
from hf_actq.kernels.rotated import rotated_dequantize, rotated_quantize
from hf_actq.kernels.sign_preserving import blpa_dequantize, blpa_quantize
from hf_actq.kernels.smaq import smaq_dequantize, smaq_quantize

__all__ = [
    "FAILED",
    "KERNELS",
    "aq_dequantize",
    "aq_quantize",
    "blpa_dequantize",
    "blpa_quantize",
    "fewbit_backward",
    "fewbit_forward",
    "gated_backward",
    "gated_forward",
    "kernels_on_cpu",
    "mask_pack",
    "mask_unpack",
    "norm_backward",
    "norm_backward_from_output",
    "norm_backward_packed",
    "norm_pack",
    "pack_codes",
    "packed_nbytes",
    "rotated_dequantize",
    "rotated_quantize",
    "seeded_dropout",
    "smaq_dequantize",
    "smaq_quantize",
    "triton_available",
    "unpack_codes",
]
