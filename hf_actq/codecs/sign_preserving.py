"""Sign-preserving clip quantization (BLPA, blpa-approximate-activations-neurips2019 §3.2).

Each block of ``block_size`` elements spans ``[-R, R]`` (R = the block's largest magnitude) split into 2**K equal intervals
whose edges include 0; a value is restored to the middle of its interval. Positive values land in
the upper half and others in the lower half, so ``x > 0`` survives exactly (what a ReLU backward
needs) and the error is at most ``R / 2**K``. Deterministic. (BLPA clips at the batch-norm range
``beta +- 3 gamma``; without batch norm the block's own range is the natural clip.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import (
    BLOCK_SIZES,
    Codec,
    Packed,
    check_floating,
    numel_of,
    validate_int,
)
from hf_actq.kernels import blpa_dequantize, blpa_quantize
from hf_actq.kernels.packing import packed_nbytes
from hf_actq.kernels.sign_preserving import blpa_layout


@dataclass(frozen=True)
class SignPreservingCodec(Codec):
    bits: int = 4
    block_size: int = 128

    name = "blpa"

    def __post_init__(self):
        validate_int("bits", self.bits, range(1, 9))
        validate_int("block_size", self.block_size, BLOCK_SIZES)
        super().__post_init__()

    def buffers(self, shape):
        n = numel_of(shape)
        return (
            (packed_nbytes(n, self.bits), torch.uint8),
            (-(-n // self.block_size), torch.float32),
        )

    def layout(self, shape):
        return blpa_layout(numel_of(shape), self.bits, self.block_size)

    def pack(self, x: torch.Tensor, seed: int | None = None) -> Packed:
        check_floating(x, self)
        # The op flattens x (the kernel reads a transposed view where it lies).
        tensors = blpa_quantize(x, self.bits, self.block_size)
        return Packed(self, x.shape, x.dtype, tensors)

    def unpack(self, packed: Packed) -> torch.Tensor:
        data, steps = packed.tensors
        return blpa_dequantize(data, steps, packed.shape, packed.dtype, self.bits, self.block_size)
