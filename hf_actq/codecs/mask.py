"""Bit-packed masks: one bit per element for boolean / zero-one tensors (dropout, ReLU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import Codec, Packed, numel_of
from hf_actq.kernels import mask_pack, mask_unpack
from hf_actq.kernels.packing import packed_nbytes


@dataclass(frozen=True)
class MaskCodec(Codec):
    """Keeps ``x != 0`` in 1 bit per element; unpacks to ``x``'s dtype with values 0 and 1.

    A dropout mask scaled by ``1 / (1 - p)`` packs the same way; multiply by the scale on use.
    """

    name = "mask"

    def buffers(self, shape):
        return ((packed_nbytes(numel_of(shape), 1), torch.uint8),)

    def pack(self, x: torch.Tensor, seed: int | None = None) -> Packed:
        return Packed(self, x.shape, x.dtype, (mask_pack(x),))

    def unpack(self, packed: Packed) -> torch.Tensor:
        (data,) = packed.tensors
        return mask_unpack(data, packed.shape, packed.dtype)
