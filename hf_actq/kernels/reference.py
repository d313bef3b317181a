"""PyTorch twins of the Triton kernels: the CPU path and the test oracle.

Every function here has the signature and the output (bit for bit, packed codes included) of its
Triton launcher in the sibling module of the same op.

Bit layout shared by every kernel: code ``i`` of width ``b`` occupies bits ``[i*b, (i+1)*b)`` of a
little-endian bit stream, so ``n`` codes take exactly ``ceil(n*b/8)`` bytes. Eight codes always
fill exactly ``b`` whole bytes, which lets kernels pack and unpack groups of eight independently.

Work proceeds in chunks of ``CHUNK`` elements so that temporaries stay in cache and their size is
bounded no matter how large the tensor is (no int64 index tensor the size of the input).
"""

from __future__ import annotations

import math

import torch

from hf_actq.fewbit.activations import get_activation

# 256 Ki elements: 1 MiB of fp32, small enough for L2, large enough to amortise op dispatch.
CHUNK = 1 << 18


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits: ``ceil(numel * bits / 8)``."""
    return (numel * bits + 7) // 8


def fewbit_forward_reference(
    x: torch.Tensor,
    activation: str,
    borders: torch.Tensor,
    bits: int,
    params: tuple[float, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activation output, packed ``bits``-bit codes and a NaN flag, in one call.

    ``borders`` (fp32) are the table's interior cut points, or ``(lo, hi)`` for activations whose
    derivative takes two values. Returns ``y`` (exactly ``activation``'s PyTorch output),
    ``packed`` (uint8, ``ceil(n*bits/8)`` bytes) and ``nan_flag`` (int32 of shape (1,), non-zero
    when ``x`` holds a NaN: codes cannot say where, so backward then yields NaN gradients rather
    than silently finite ones).
    """
    spec = get_activation(activation)
    y = spec.forward(x, **dict(zip(spec.params, params)))
    n = x.numel()
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    flat = x.reshape(-1)
    cuts = borders.tolist()
    nan_seen = torch.zeros(1, dtype=torch.bool, device=x.device)
    codes = torch.empty(min(n, CHUNK) + 8, dtype=torch.uint8, device=x.device)
    hits = torch.empty(min(n, CHUNK), dtype=torch.bool, device=x.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        # Compare in fp32 as the Triton kernel does: a Python scalar against a bf16 tensor would be
        # rounded to bf16 first and move the border.
        v = flat[start:stop].float()
        # max() propagates NaN, so one cheap reduction over cached data finds any NaN.
        nan_seen |= torch.isnan(v.max())
        if spec.code_mode == "symmetric":
            v = v.abs()
        c, hit = codes[:m], hits[:m]
        if spec.code_mode == "interval":
            torch.gt(v, cuts[0], out=c)
            torch.lt(v, cuts[1], out=hit)
            c.mul_(hit)
        else:
            c.zero_()
            for cut in cuts:
                torch.gt(v, cut, out=hit)
                c.add_(hit)
        padded = (m + 7) // 8 * 8
        codes[m:padded] = 0
        byte_start = start * bits // 8
        packed[byte_start : byte_start + packed_nbytes(m, bits)] = _pack(codes[:padded], bits)[
            : packed_nbytes(m, bits)
        ]
    return y, packed, nan_seen.to(torch.int32)


def fewbit_backward_reference(
    grad_y: torch.Tensor,
    packed: torch.Tensor,
    levels: torch.Tensor,
    nan_flag: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    """``grad_y * levels[code]``, the product taken in fp32 and rounded once to grad_y's dtype."""
    n = grad_y.numel()
    flat = grad_y.reshape(-1)
    lut = levels.float() * torch.where(nan_flag.bool(), math.nan, 1.0)
    expanded, index_of = _expanded_lookup(lut, bits)
    out = torch.empty(n, dtype=grad_y.dtype, device=grad_y.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        byte_start = start * bits // 8
        chunk = packed[byte_start : byte_start + packed_nbytes(m, bits)]
        group_bytes = (m + 7) // 8 * bits
        if chunk.numel() < group_bytes:
            chunk = torch.cat([chunk, chunk.new_zeros(group_bytes - chunk.numel())])
        level = expanded.index_select(0, index_of(chunk)).view(-1)[:m]
        torch.mul(flat[start:stop], level, out=out[start:stop])
    return out.view(grad_y.shape)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2**bits) into ``ceil(n*bits/8)`` bytes."""
    n = codes.numel()
    flat = codes.reshape(-1).to(torch.uint8)
    padded = (n + 7) // 8 * 8
    if padded != n:
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    return _pack(flat, bits)[: packed_nbytes(n, bits)]


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``numel`` uint8 codes."""
    levels = torch.arange(2**bits, dtype=torch.float32, device=packed.device)
    ones = torch.ones(numel, dtype=torch.float32, device=packed.device)
    flag = torch.zeros(1, dtype=torch.int32, device=packed.device)
    return fewbit_backward_reference(ones, packed, levels, flag, bits).to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a multiple-of-8 run of uint8 codes; a float GEMV forms each word exactly (< 2**24)."""
    if bits in (1, 2, 4, 8):
        per_byte = 8 // bits
        weights = torch.tensor(
            [float(1 << (bits * j)) for j in range(per_byte)], device=codes.device
        )
        return (codes.view(-1, per_byte).float() @ weights).to(torch.uint8)
    if bits == 3:
        weights = torch.tensor([float(1 << (3 * j)) for j in range(8)], device=codes.device)
        word = (codes.view(-1, 8).float() @ weights).to(torch.int32)
        shifts = torch.tensor([0, 8, 16], dtype=torch.int32, device=codes.device)
        return ((word[:, None] >> shifts) & 0xFF).to(torch.uint8).view(-1)
    raise ValueError(f"bits must be one of 1, 2, 3, 4, 8 for packing, got {bits}")


def _expanded_lookup(lut: torch.Tensor, bits: int):
    """A table of levels per packed index, and how to index it from packed bytes.

    Decoding byte by byte (or 12 bits at a time for 3-bit codes, which straddle bytes) turns
    unpacking and the level lookup into one row gather.
    """
    device = lut.device
    if bits in (1, 2, 4, 8):
        per_byte = 8 // bits
        index = torch.arange(256, device=device)
        shifts = torch.arange(per_byte, device=device) * bits
        codes = (index[:, None] >> shifts) & (2**bits - 1)
        return lut[codes], lambda chunk: chunk.to(torch.int32)
    if bits == 3:
        index = torch.arange(4096, device=device)
        shifts = torch.arange(4, device=device) * 3
        codes = (index[:, None] >> shifts) & 7

        def index_of(chunk):
            b = chunk.view(-1, 3).to(torch.int32)
            word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            return torch.stack([word & 0xFFF, word >> 12], dim=1).view(-1)

        return lut[codes], index_of
    raise ValueError(f"bits must be one of 1, 2, 3, 4, 8 for unpacking, got {bits}")
