"""Rotated sampling: ALAM's sub-1-bit budgets without the bias of averaging, for the inputs that
a weight gradient is formed from.

Why not average quantization there: AQ replaces each run of ``g`` adjacent features by its
mean, so a linear layer's weight gradient ``dY^T X`` becomes ``dY^T X_avg``, whose ``g`` columns in
each group are equal. Every update is projected onto a ``1/g``-dimensional subspace of the weight
space; no rounding seed changes that, so it never averages out over steps, and the adaptive
pass's seed-to-seed variance cannot see it. On the pretrained MiniLM (a real MRPC batch) averaging
alone (8-bit means) turns the whole-model gradient to cosine 0.70, 0.54 and 0.42 for
groups of 2, 4 and 8, and its length shrinks by the same factors (measured by
``benchmarks/bench_gradients.py --minilm-bias``).

This codec spends the same bytes without bias. Each run of ``ROTATION`` (128) values of the flat
tensor is multiplied by random signs ``D`` (regenerated in backward from the pack's seed), rotated
by the normalized Hadamard matrix, and only the first ``128 / g`` coefficients ``H_k D x`` are
kept, stochastically rounded to ``bits`` bits against a per-block minimum and scale (AQ's kernels
with group 1). Unpacking returns ``g D H_k^T q``. Since ``E_D[D H_k^T H_k D] = diag(H_k^T H_k) =
I / g``, ``E[x_hat] = x``: the weight gradient is unbiased and its error averages out over tokens
and steps, as stochastic rounding's does. The error's variance is ``(g - 1) ||x||^2`` plus the
rounding's, and the rotation spreads outlier features over 128 coefficients, so the rounding's
range stays narrow. ``bits / g`` bits per element: ``g=2, bits=2`` is the 1-bit setting.

Only for tensors whose backward is linear in them (linear-layer inputs): through a norm or a
softmax, zero-mean noise of that size does not stay zero-mean.

``g = 1`` keeps all 128 coefficients: rotated uniform rounding, exactly the bytes of uniform
stochastic rounding and no sampling error, only the rounding's, which the rotation makes
smaller: a block's range is set by its largest value, and rotated, an outlier feature is spread
thin over 128 coefficients instead of widening its block's step for the 127 values beside it
(QuaRot's observation, here for stored activations). Nothing is sampled, so the signs need not
be random per pack: one fixed sign vector, folded into the rotation, makes pack and unpack one
matrix product each (inside the pack and unpack kernels on a GPU: ``kernels/rotated.py``), and
no seed is stored. On the pretrained MiniLM's layer inputs (CoLA
sentences) 4-bit codes lose 6.5% of the energy unrotated and 1.6% rotated.
"""

from __future__ import annotations

import functools
import math
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
from hf_actq.kernels import aq_dequantize, aq_quantize, rotated_dequantize, rotated_quantize
from hf_actq.kernels.average_quant import aq_layout
from hf_actq.kernels.packing import packed_nbytes
from hf_actq.kernels.rotated import ROTATION, coefficient_dtype

GROUP_SIZES = (1, 2, 4, 8, 16)
# Rows of ROTATION values rotated at a time: bounds the fp32 transients to 8 MiB.
_SLAB_ROWS = 1 << 14


@functools.lru_cache(maxsize=32)
def _hadamard_rows(keep: int, device: torch.device) -> torch.Tensor:
    """The first ``keep`` rows of the normalized ``ROTATION``-point Hadamard matrix (fp32)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < ROTATION:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h[:keep] / math.sqrt(ROTATION)).to(device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=32)
def _fixed_rotation(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``D H^T`` for one fixed random sign vector ``D``: ``x @ it`` rotates rows of 128 values,
    ``y @ it.T`` rotates them back (the matrix is orthogonal)."""
    # Drawn on the CPU whatever torch's default device: the same signs on every device.
    generator = torch.Generator(device="cpu").manual_seed(0x5EED)
    signs = torch.randint(0, 2, (ROTATION,), generator=generator, device="cpu")
    rotation = (signs.to(torch.float32) * 2 - 1)[:, None] * _hadamard_rows(ROTATION, "cpu").T
    return rotation.to(device=device, dtype=dtype)


def _signs(generator: torch.Generator, rows: int, device) -> torch.Tensor:
    bits = torch.randint(0, 2, (rows, ROTATION), generator=generator, device=device)
    return bits.to(torch.float32).mul_(2).sub_(1)


@dataclass(frozen=True)
class RotatedSampleCodec(Codec):
    bits: int = 2
    group_size: int = 2
    block_size: int = 128
    stochastic: bool = True

    name = "rotated"
    cpu_buffers = (3,)  # the seed of the signs, when sampled (group_size > 1)

    @property
    def uses_rng(self) -> bool:
        # Sampled coefficients take their signs from a seed even without stochastic rounding.
        return self.stochastic or self.group_size > 1

    @property
    def takes_device_seed(self) -> bool:
        # Every coefficient kept: the seed only rounds (AQ's kernel reads it on the device).
        # Sampled: the signs come from a generator seeded on the host.
        return self.group_size == 1

    def layout(self, shape):
        if self.group_size > 1:
            return None  # the signs' seed is a CPU tensor of its own
        return aq_layout(self._rows(shape) * ROTATION, self.bits, self.block_size)

    def __post_init__(self):
        validate_int("bits", self.bits, range(1, 9))
        validate_int("group_size", self.group_size, GROUP_SIZES)
        validate_int("block_size", self.block_size, BLOCK_SIZES)
        super().__post_init__()

    def _rows(self, shape) -> int:
        return -(-numel_of(shape) // ROTATION)

    def buffers(self, shape):
        kept = self._rows(shape) * (ROTATION // self.group_size)
        blocks = -(-kept // self.block_size)
        # Codes, a min and a scale per block, and when sampled the seed of the signs (on the
        # CPU).
        codes = (
            (packed_nbytes(kept, self.bits), torch.uint8),
            (blocks, torch.float32),
            (blocks, torch.float32),
        )
        return codes if self.group_size == 1 else (*codes, (1, torch.int64))

    def pack(self, x: torch.Tensor, seed: int | torch.Tensor | None = None) -> Packed:
        check_floating(x, self)
        if seed is None and self.uses_rng:
            seed = draw_seed()
        with _exact_products(x.device):
            return self._pack(x, seed)

    def _pack(self, x: torch.Tensor, seed: int | None) -> Packed:
        if self.group_size == 1:
            return self._pack_whole(x, seed)
        flat = x.detach().reshape(-1)
        rows, keep = self._rows(x.shape), ROTATION // self.group_size
        rotation = _hadamard_rows(keep, x.device)
        coeffs = torch.empty(rows, keep, dtype=coefficient_dtype(x.dtype), device=x.device)
        generator = torch.Generator(device=x.device).manual_seed(seed)
        for start in range(0, rows, _SLAB_ROWS):
            stop = min(rows, start + _SLAB_ROWS)
            slab = flat[start * ROTATION : stop * ROTATION].float()
            slab = torch.nn.functional.pad(slab, (0, (stop - start) * ROTATION - slab.numel()))
            slab = slab.view(-1, ROTATION).mul_(_signs(generator, stop - start, x.device))
            coeffs[start:stop] = slab @ rotation.T
        data, mins, scales = aq_quantize(
            coeffs.reshape(-1), 1, self.bits, self.block_size, self.stochastic, seed
        )
        seed_tensor = torch.tensor([seed], dtype=torch.int64, device="cpu")  # cpu_buffers
        return Packed(self, x.shape, x.dtype, (data, mins, scales, seed_tensor))

    def _pack_whole(self, x: torch.Tensor, seed: int | torch.Tensor | None) -> Packed:
        """Every coefficient kept: ``x @ D H^T`` and AQ's rounding (one kernel on a GPU)."""
        rotation = _fixed_rotation(x.device, coefficient_dtype(x.dtype))
        data, mins, scales = rotated_quantize(
            x, rotation, self.bits, self.block_size, self.stochastic, *seed_arguments(seed)
        )
        return Packed(self, x.shape, x.dtype, (data, mins, scales))

    def _unpack_whole(self, packed: Packed) -> torch.Tensor:
        data, mins, scales = packed.tensors
        rotation = _fixed_rotation(data.device, coefficient_dtype(packed.dtype))
        shape = list(packed.shape)
        args = (packed.dtype, self.bits, self.block_size)
        return rotated_dequantize(data, mins, scales, rotation, shape, *args)

    def unpack(self, packed: Packed) -> torch.Tensor:
        with _exact_products(packed.tensors[0].device):
            return self._unpack(packed)

    def _unpack(self, packed: Packed) -> torch.Tensor:
        if self.group_size == 1:
            return self._unpack_whole(packed)
        data, mins, scales, seed_tensor = packed.tensors
        rows, keep = self._rows(packed.shape), ROTATION // self.group_size
        device = data.device
        coeffs = aq_dequantize(
            data,
            mins,
            scales,
            torch.Size((rows, keep)),
            coefficient_dtype(packed.dtype),
            self.bits,
            1,
            self.block_size,
        )
        rotation = _hadamard_rows(keep, device) * self.group_size
        generator = torch.Generator(device=device).manual_seed(int(seed_tensor[0]))
        out = torch.empty(packed.shape, dtype=packed.dtype, device=device).reshape(-1)
        for start in range(0, rows, _SLAB_ROWS):
            stop = min(rows, start + _SLAB_ROWS)
            slab = (coeffs[start:stop].float() @ rotation).mul_(
                _signs(generator, stop - start, device)
            )
            piece = out[start * ROTATION : stop * ROTATION]
            piece.copy_(slab.view(-1)[: piece.numel()])
        return out.view(packed.shape)


def _exact_products(device: torch.device):
    """Autocast off around the rotations: it would run them in bf16 or fp16 whatever the
    coefficients' dtype, and rotate back with other rounding than the forward's."""
    return torch.autocast(device.type, enabled=False)
