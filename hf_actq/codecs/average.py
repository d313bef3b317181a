"""Average quantization (ALAM, alam-iclr2024 §3) and uniform stochastic rounding (ActNN/GACT).

``AverageQuantCodec(bits=b, group_size=G)`` replaces each run of ``G`` adjacent elements along
the last dimension by its mean, then quantizes the means to ``b`` bits with stochastic rounding
against a per-block minimum and scale (``block_size`` means per block, both kept in fp32).
``G = 1`` is plain uniform stochastic rounding; "AQ 0.5-bit" is ``G=4, b=2``. Unpacking repeats
each dequantized mean ``G`` times, which is what ALAM's backward uses.

Stochastic rounding is driven by one seed per pack drawn from torch's RNG
(:func:`~hf_actq.codecs.packed.draw_seed`), so ``torch.manual_seed`` reproduces a run and
checkpointing's RNG replay recomputes identical codes.
Work proceeds in chunks, so no full-size fp32 copy of a half-precision input is ever made. A
block whose range (max - min) exceeds the float32 maximum dequantizes to inf at its top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import (
    BLOCK_SIZES,
    Codec,
    Packed,
    check_floating,
    draw_seed,
    numel_of,
    seed_arguments,
    validate_int,
)
from hf_actq.kernels import aq_dequantize, aq_quantize
from hf_actq.kernels.average_quant import aq_layout
from hf_actq.kernels.packing import packed_nbytes

GROUP_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class AverageQuantCodec(Codec):
    bits: int = 2
    group_size: int = 1
    block_size: int = 128
    stochastic: bool = True

    name = "aq"
    takes_device_seed = True

    def __post_init__(self):
        validate_int("bits", self.bits, range(1, 9))
        validate_int("group_size", self.group_size, GROUP_SIZES)
        validate_int("block_size", self.block_size, BLOCK_SIZES)
        super().__post_init__()

    # Sizes -----------------------------------------------------------------------------------
    def _num_means(self, shape) -> int:
        shape = tuple(shape)
        if not shape:
            return 1
        last = shape[-1]
        return numel_of(shape[:-1]) * -(-last // self.group_size)

    def buffers(self, shape):
        means = self._num_means(shape)
        blocks = -(-means // self.block_size)
        # Codes, then a min and a scale per block.
        return (
            (packed_nbytes(means, self.bits), torch.uint8),
            (blocks, torch.float32),
            (blocks, torch.float32),
        )

    def layout(self, shape):
        return aq_layout(self._num_means(shape), self.bits, self.block_size)

    # Pack / unpack ---------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, seed: int | torch.Tensor | None = None) -> Packed:
        check_floating(x, self)
        if self.stochastic and seed is None:
            seed = draw_seed()
        g = self.group_size
        last = x.shape[-1] if x.dim() else 1
        if g == 1 or last % g == 0:
            # Groups are runs of the flat tensor; the op flattens it (the kernel reads a
            # transposed view where it lies).
            source, group = x, g
        else:
            source, group = self._means(x), 1  # partial groups: average them here
        tensors = aq_quantize(
            source, group, self.bits, self.block_size, self.stochastic, *seed_arguments(seed)
        )
        return Packed(self, x.shape, x.dtype, tensors)

    def unpack(self, packed: Packed) -> torch.Tensor:
        data, mins, scales = packed.tensors
        return aq_dequantize(
            data,
            mins,
            scales,
            packed.shape,
            packed.dtype,
            self.bits,
            self.group_size,
            self.block_size,
        )

    # Grouping --------------------------------------------------------------------------------
    def _means(self, x: torch.Tensor) -> torch.Tensor:
        """Flat group means (fp32 accumulation) of a tensor whose last dim is not a multiple of
        the group size."""
        g = self.group_size
        last = x.shape[-1] if x.dim() else 1
        rows = x.reshape(-1, last)
        # The last group of each row is partial: average over the elements it really has.
        padded = torch.nn.functional.pad(rows, (0, g - last % g))
        sums = padded.view(rows.shape[0], -1, g).sum(dim=2, dtype=torch.float32)
        counts = torch.full((sums.shape[1],), float(g), device=x.device)
        counts[-1] = last % g
        return (sums / counts).to(x.dtype).reshape(-1)


def uniform(bits: int = 4, block_size: int = 128, stochastic: bool = True) -> AverageQuantCodec:
    """Uniform stochastic rounding (ActNN/GACT style): average quantization with group size 1."""
    return AverageQuantCodec(bits=bits, group_size=1, block_size=block_size, stochastic=stochastic)
