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

from hf_actq.codecs.packed import Codec, Packed, check_floating, validate_int
from hf_actq.kernels.reference import pack_codes, packed_nbytes, unpack_codes

_CHUNK = 1 << 16


@dataclass(frozen=True)
class SignPreservingCodec(Codec):
    bits: int = 4
    block_size: int = 128

    name = "blpa"

    def __post_init__(self):
        validate_int("bits", self.bits, range(1, 9))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.block_size < 1 or _CHUNK % self.block_size:
            raise ValueError(
                f"block_size must be a power of two in 1..{_CHUNK}, got {self.block_size}"
            )

    def nbytes(self, shape) -> int:
        n = torch.Size(shape).numel()
        return packed_nbytes(n, self.bits) + -(-n // self.block_size) * 4

    def pack(self, x: torch.Tensor) -> Packed:
        check_floating(x, self)
        flat = x.reshape(-1)
        n = flat.numel()
        half = 2 ** (self.bits - 1)
        blocks = -(-n // self.block_size)
        steps = torch.empty(blocks, dtype=torch.float32, device=x.device)
        codes = torch.empty(n, dtype=torch.uint8, device=x.device)
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            chunk = flat[start:stop].float()
            view = _blocked_zero_padded(chunk, self.block_size)
            step = view.abs().amax(dim=1) / half
            steps[start // self.block_size : -(-stop // self.block_size)] = step
            inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
            # ceil(x / step) - 1: x in (0, step] -> 0 (upper half), x = 0 -> -1 (lower half).
            q = torch.ceil(view * inv[:, None]) - 1
            q = q.view(-1)[: stop - start].clamp_(-half, half - 1).add_(half)
            codes[start:stop] = q.to(torch.uint8)
        return Packed(self, x.shape, x.dtype, (pack_codes(codes, self.bits), steps))

    def unpack(self, packed: Packed) -> torch.Tensor:
        data, steps = packed.tensors
        n = packed.numel
        half = 2 ** (self.bits - 1)
        codes = unpack_codes(data, n, self.bits)
        out = torch.empty(n, dtype=packed.dtype, device=data.device)
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            block = torch.arange(start, stop, device=data.device) // self.block_size
            values = (codes[start:stop].float() - (half - 0.5)) * steps[block]
            out[start:stop] = values.to(packed.dtype)
        return out.view(packed.shape)


def _blocked_zero_padded(chunk: torch.Tensor, block: int) -> torch.Tensor:
    n = chunk.numel()
    rows = -(-n // block)
    if rows * block == n:
        return chunk.view(rows, block)
    return torch.nn.functional.pad(chunk, (0, rows * block - n)).view(rows, block)
