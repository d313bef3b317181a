"""SmaQ (smaq-ieee-cal2021): z-score quantization with short inlier and long outlier codes.

Values are normalised with the tensor's mean and standard deviation. Inliers (``|z| <= 1``) get
5 data bits plus a flag; outliers are clipped at ``|z| = 2`` and get 7 data bits (sign and a
6-bit magnitude) plus a flag, all with stochastic rounding: SmaQ (6, 8).

The paper's codes have data-dependent length; saved buffers here must have a size that depends
only on the shape (checkpoint recompute compares them). So every element takes a 6-bit main code
(flag, then 5 data bits: an inlier's code, or an outlier's sign and top 4 magnitude bits), and
each block of ``block_size`` elements reserves ``capacity`` 2-bit slots for the low magnitude bits
of its first outliers in element order. Further outliers of a crowded block keep a 4-bit
magnitude, still stochastically rounded, so still unbiased. With normal data about 32% of values
are outliers, and the default capacity of 3/8 of a block leaves them all their 7 bits:
6.75 bits per element plus 8 bytes of statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import (
    Codec,
    Packed,
    check_floating,
    draw_seed,
    numel_of,
    seed_arguments,
    validate_int,
)
from hf_actq.kernels import smaq_dequantize, smaq_quantize
from hf_actq.kernels.packing import packed_nbytes
from hf_actq.kernels.smaq import smaq_layout

BLOCK_SIZES = (64, 128, 256)


@dataclass(frozen=True)
class SmaQCodec(Codec):
    block_size: int = 256
    capacity: float = 0.375
    stochastic: bool = True

    name = "smaq"
    takes_device_seed = True

    def __post_init__(self):
        validate_int("block_size", self.block_size, BLOCK_SIZES)
        if isinstance(self.capacity, bool) or not 0.0 <= self.capacity <= 1.0:
            raise ValueError(f"capacity must be a fraction in [0, 1], got {self.capacity!r}")
        super().__post_init__()

    @property
    def slots(self) -> int:
        """Extension slots per block, a multiple of 4 so that each block's slots fill bytes."""
        return min(self.block_size, -(-round(self.capacity * self.block_size) // 4) * 4)

    def buffers(self, shape):
        n = numel_of(shape)
        blocks = -(-n // self.block_size)
        # 6-bit main codes, 2-bit extension slots, fp32 mean and std.
        return (
            (packed_nbytes(n, 6), torch.uint8),
            (blocks * self.slots // 4, torch.uint8),
            (2, torch.float32),
        )

    def layout(self, shape):
        return smaq_layout(numel_of(shape), self.block_size, self.slots)

    def pack(self, x: torch.Tensor, seed: int | torch.Tensor | None = None) -> Packed:
        check_floating(x, self)
        if self.stochastic and seed is None:
            seed = draw_seed()
        # (main, extension, stats): one allocation; a transposed q, k or v is not copied first.
        buffers = smaq_quantize(
            x, self.block_size, self.slots, self.stochastic, *seed_arguments(seed)
        )
        return Packed(self, x.shape, x.dtype, tuple(buffers))

    def unpack(self, packed: Packed) -> torch.Tensor:
        main, extension, stats = packed.tensors
        return smaq_dequantize(
            main, extension, stats, packed.shape, packed.dtype, self.block_size, self.slots
        )
