"""Average quantization (ALAM, alam-iclr2024 §3) and uniform stochastic rounding (ActNN/GACT).

``AverageQuantCodec(bits=b, group_size=G)`` replaces each run of ``G`` adjacent elements along
the last dimension by its mean, then quantizes the means to ``b`` bits with stochastic rounding
against a per-block minimum and scale (``block_size`` means per block, both kept in fp32).
``G = 1`` is plain uniform stochastic rounding; "AQ 0.5-bit" is ``G=4, b=2``. Unpacking repeats
each dequantized mean ``G`` times, which is what ALAM's backward uses.

Stochastic rounding draws its noise with ``torch.rand`` on the tensor's device, so
``torch.manual_seed`` reproduces a run and checkpointing's RNG replay recomputes identical codes.
Work proceeds in chunks, so no full-size fp32 copy of a half-precision input is ever made. A
block whose range (max - min) exceeds the float32 maximum dequantizes to inf at its top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_actq.codecs.packed import Codec, Packed, check_floating, validate_int
from hf_actq.kernels.reference import pack_codes, packed_nbytes, unpack_codes

GROUP_SIZES = (1, 2, 4, 8, 16)
# Means per chunk (a multiple of every block size used in practice and of 8).
_CHUNK = 1 << 16


@dataclass(frozen=True)
class AverageQuantCodec(Codec):
    bits: int = 2
    group_size: int = 1
    block_size: int = 128
    stochastic: bool = True

    name = "aq"

    def __post_init__(self):
        validate_int("bits", self.bits, range(1, 9))
        validate_int("group_size", self.group_size, GROUP_SIZES)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.block_size < 1 or _CHUNK % self.block_size:
            raise ValueError(
                f"block_size must be a power of two in 1..{_CHUNK}, got {self.block_size}"
            )

    # Sizes -----------------------------------------------------------------------------------
    def _num_means(self, shape) -> int:
        shape = tuple(shape)
        if not shape:
            return 1
        last = shape[-1]
        rows = torch.Size(shape[:-1]).numel()
        return rows * -(-last // self.group_size)

    def nbytes(self, shape) -> int:
        means = self._num_means(shape)
        blocks = -(-means // self.block_size)
        return packed_nbytes(means, self.bits) + blocks * 2 * 4

    # Pack / unpack ---------------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> Packed:
        check_floating(x, self)
        means = self._means(x)
        m = means.numel()
        blocks = -(-m // self.block_size)
        mins = torch.empty(blocks, dtype=torch.float32, device=x.device)
        scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
        codes = torch.empty(m, dtype=torch.uint8, device=x.device)
        top = 2**self.bits - 1
        for start in range(0, m, _CHUNK):
            stop = min(m, start + _CHUNK)
            chunk = means[start:stop].float()
            b0, b1 = start // self.block_size, -(-stop // self.block_size)
            view = _blocked(chunk, self.block_size)
            lo, hi = view.amin(dim=1), view.amax(dim=1)
            # hi / top - lo / top rather than (hi - lo) / top: the range of a block spanning
            # most of the fp32 (or bf16) range would overflow.
            scale = hi / top - lo / top
            mins[b0:b1], scales[b0:b1] = lo, scale
            inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
            q = view * inv[:, None] - (lo * inv)[:, None]
            q = q.view(-1)[: stop - start]
            if self.stochastic:
                q.add_(torch.rand(q.shape, device=q.device))
                q.floor_()
            else:
                q.round_()
            codes[start:stop] = q.clamp_(0, top).to(torch.uint8)
        return Packed(self, x.shape, x.dtype, (pack_codes(codes, self.bits), mins, scales))

    def unpack(self, packed: Packed) -> torch.Tensor:
        data, mins, scales = packed.tensors
        m = self._num_means(packed.shape)
        codes = unpack_codes(data, m, self.bits)
        means = torch.empty(m, dtype=packed.dtype, device=data.device)
        for start in range(0, m, _CHUNK):
            stop = min(m, start + _CHUNK)
            block = torch.arange(start, stop, device=data.device) // self.block_size
            values = mins[block] + codes[start:stop].float() * scales[block]
            means[start:stop] = values.to(packed.dtype)
        return self._expand(means, packed.shape)

    # Grouping --------------------------------------------------------------------------------
    def _means(self, x: torch.Tensor) -> torch.Tensor:
        """Flat tensor of group means, in x's dtype (fp32 accumulation)."""
        g = self.group_size
        if g == 1 or x.numel() == 0:
            return x.reshape(-1)[: self._num_means(x.shape)]
        last = x.shape[-1] if x.dim() else 1
        rows = x.reshape(-1, last)
        if last % g == 0:
            return rows.reshape(-1, g).mean(dim=1, dtype=torch.float32).to(x.dtype)
        # The last group of each row is partial: average over the elements it really has.
        padded = torch.nn.functional.pad(rows, (0, g - last % g))
        sums = padded.view(rows.shape[0], -1, g).sum(dim=2, dtype=torch.float32)
        counts = torch.full((sums.shape[1],), float(g), device=x.device)
        counts[-1] = last % g
        return (sums / counts).to(x.dtype).reshape(-1)

    def _expand(self, means: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        g = self.group_size
        if shape.numel() == 0:
            return means.new_empty(shape)
        if g == 1:
            return means.view(shape)
        last = shape[-1] if len(shape) else 1
        per_row = -(-last // g)
        full = means.view(-1, per_row).repeat_interleave(g, dim=1)[:, :last]
        return full.reshape(shape)


def _blocked(chunk: torch.Tensor, block: int) -> torch.Tensor:
    """``chunk`` as rows of ``block``; a partial last block is padded with its own last value,
    which leaves its min and max unchanged."""
    n = chunk.numel()
    rows = -(-n // block)
    if rows * block == n:
        return chunk.view(rows, block)
    padded = torch.empty(rows * block, dtype=chunk.dtype, device=chunk.device)
    padded[:n] = chunk
    padded[n:] = chunk[-1]
    return padded.view(rows, block)


def uniform(bits: int = 4, block_size: int = 128, stochastic: bool = True) -> AverageQuantCodec:
    """Uniform stochastic rounding (ActNN/GACT style): average quantization with group size 1."""
    return AverageQuantCodec(bits=bits, group_size=1, block_size=block_size, stochastic=stochastic)
