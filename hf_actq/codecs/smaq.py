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

from hf_actq.codecs.packed import Codec, Packed, check_floating, draw_seed, validate_int
from hf_actq.kernels.reference import pack_codes, packed_nbytes, unpack_codes

BLOCK_SIZES = (64, 128, 256)
_CHUNK_BLOCKS = 256


@dataclass(frozen=True)
class SmaQCodec(Codec):
    block_size: int = 256
    capacity: float = 0.375

    name = "smaq"
    uses_rng = True

    def __post_init__(self):
        validate_int("block_size", self.block_size, BLOCK_SIZES)
        if isinstance(self.capacity, bool) or not 0.0 <= self.capacity <= 1.0:
            raise ValueError(f"capacity must be a fraction in [0, 1], got {self.capacity!r}")

    @property
    def slots(self) -> int:
        """Extension slots per block, a multiple of 4 so that each block's slots fill bytes."""
        return min(self.block_size, -(-round(self.capacity * self.block_size) // 4) * 4)

    def nbytes(self, shape) -> int:
        n = torch.Size(shape).numel()
        blocks = -(-n // self.block_size)
        return packed_nbytes(n, 6) + blocks * self.slots // 4 + 8  # + fp32 mean and std

    def pack(self, x: torch.Tensor, seed: int | None = None) -> Packed:
        check_floating(x, self)
        flat = x.reshape(-1)
        n = flat.numel()
        if seed is None:
            seed = draw_seed()
        stats = _mean_std(flat)
        mean, std = stats[0].item(), stats[1].item()
        inv_std = 1.0 / std if std > 0 else 0.0
        generator = torch.Generator(device=x.device)
        generator.manual_seed(seed)
        block, slots = self.block_size, self.slots
        blocks = -(-n // block)
        main = torch.empty(blocks * block, dtype=torch.uint8, device=x.device)
        extension = torch.zeros(blocks, max(slots, 1), dtype=torch.uint8, device=x.device)
        step = _CHUNK_BLOCKS * block
        for start in range(0, n, step):
            stop = min(n, start + step)
            rows = -(-(stop - start) // block)
            chunk = torch.zeros(rows * block, dtype=torch.float32, device=x.device)
            chunk[: stop - start] = flat[start:stop]
            z = ((chunk - mean) * inv_std).clamp_(-2.0, 2.0).view(rows, block)
            u = torch.rand(z.shape, device=x.device, generator=generator)
            valid = (torch.arange(rows * block, device=x.device) < stop - start).view(rows, block)
            outlier = (z.abs() > 1.0) & valid
            inlier_code = torch.floor((z + 1.0) * 15.5 + u).clamp_(0, 31)
            magnitude = z.abs() - 1.0
            fine = torch.floor(magnitude * 63.0 + u).clamp_(0, 63)
            coarse = torch.floor(magnitude * 15.0 + u).clamp_(0, 15)
            rank = torch.cumsum(outlier.to(torch.int32), dim=1) - 1
            extended = outlier & (rank < slots)
            top = torch.where(extended, torch.floor(fine / 4), coarse)
            outlier_code = 32 + 16 * (z < 0).float() + top
            code = torch.where(outlier, outlier_code, inlier_code)
            main[start : start + rows * block] = code.view(-1).to(torch.uint8)
            if slots:
                low = (fine - 4 * torch.floor(fine / 4)).to(torch.uint8)
                b0 = start // block
                ext = extension[b0 : b0 + rows]
                row_index = torch.arange(rows, device=x.device)[:, None].expand_as(rank)
                ext[row_index[extended], rank[extended]] = low[extended]
        tensors = (
            pack_codes(main[:n], 6),
            pack_codes(extension[:, :slots].reshape(-1), 2) if slots else main.new_empty(0),
            stats,
        )
        return Packed(self, x.shape, x.dtype, tensors)

    def unpack(self, packed: Packed) -> torch.Tensor:
        data, ext_data, stats = packed.tensors
        n = packed.numel
        if n == 0:
            return torch.empty(packed.shape, dtype=packed.dtype, device=data.device)
        block, slots = self.block_size, self.slots
        blocks = -(-n // block)
        main = torch.zeros(blocks * block, dtype=torch.int32, device=data.device)
        main[:n] = unpack_codes(data, n, 6).to(torch.int32)
        main = main.view(blocks, block)
        outlier = main >= 32
        inlier_z = main.float() / 15.5 - 1.0
        top = (main & 15).float()
        rank = torch.cumsum(outlier.to(torch.int32), dim=1) - 1
        extended = outlier & (rank < slots)
        magnitude = top / 15.0
        if slots:
            ext = unpack_codes(ext_data, blocks * slots, 2).view(blocks, slots).float()
            low = ext.gather(1, rank.clamp(0, slots - 1).to(torch.int64))
            magnitude = torch.where(extended, (4 * top + low) / 63.0, magnitude)
        sign = torch.where((main & 16) > 0, -1.0, 1.0)
        z = torch.where(outlier, sign * (1.0 + magnitude), inlier_z)
        values = z.view(-1)[:n] * stats[1] + stats[0]
        return values.to(packed.dtype).view(packed.shape)


def _mean_std(flat: torch.Tensor) -> torch.Tensor:
    """fp32 [mean, std] of a tensor, accumulated in fp64 chunk by chunk (no fp32 copy)."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    squares = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), 1 << 20):
        chunk = flat[start : start + (1 << 20)].double()
        total += chunk.sum()
        squares += (chunk * chunk).sum()
    n = max(flat.numel(), 1)
    mean = total / n
    var = (squares / n - mean * mean).clamp_min(0.0)
    return torch.stack([mean, var.sqrt()]).float()
