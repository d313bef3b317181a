"""The bit layout every kernel shares, and the helpers the PyTorch twins pack and unpack with.

Code ``i`` of width ``b`` occupies bits ``[i*b, (i+1)*b)`` of a little-endian bit stream, so ``n``
codes take exactly ``ceil(n*b/8)`` bytes. Eight codes always fill exactly ``b`` whole bytes, which
lets kernels pack and unpack groups of eight independently (``triton_common.py`` holds the Triton
side of the same layout).

Twins work in chunks so that temporaries stay in cache and their size is bounded no matter how
large the tensor is (no int64 index tensor the size of the input).
"""

from __future__ import annotations

import functools
import sys

import torch

from hf_actq.kernels.compiled import run

if sys.byteorder != "little":
    raise ImportError(
        "hf_actq's bit packing views words as bytes and needs a little-endian machine"
    )

# 256 Ki elements: 1 MiB of fp32, small enough for L2, large enough to amortise op dispatch.
CHUNK = 1 << 18
# Codec values per eager chunk (a multiple of every allowed block size), and per compiled chunk
# (bounds the uint8 codes between the passes).
CODEC_CHUNK = 1 << 16
COMPILED_CHUNK = 1 << 22


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits: ``ceil(numel * bits / 8)``."""
    return (numel * bits + 7) // 8


# Where each of a pack's tensors lies in its one allocation: (byte offset, elements, dtype), in the
# pack's tensor order. Metadata (fp32) leads, so its offsets stay 4-byte aligned.
Layout = tuple[tuple[int, int, torch.dtype], ...]


def allocation_bytes(layout: Layout) -> int:
    return max((offset + n * dtype.itemsize for offset, n, dtype in layout), default=0)


def views_of(buffer: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The pack's tensors: views of ``buffer`` (uint8) as ``layout`` places them."""
    plan = _split_plan(layout)
    if plan is None or buffer.numel() != plan[2]:
        return tuple(
            buffer[offset : offset + n * dtype.itemsize].view(dtype) for offset, n, dtype in layout
        )
    sizes, places, _ = plan
    # One split of the buffer (one dispatch; a slice and a view per tensor took about 10 µs of
    # host time a pack), then the float views.
    parts = buffer.split_with_sizes(sizes)
    return tuple(
        parts[place] if dtype == torch.uint8 else parts[place].view(dtype)
        for place, (_, _, dtype) in zip(places, layout)
    )


@functools.lru_cache(maxsize=1024)
def _split_plan(layout: Layout) -> tuple[list[int], list[int], int] | None:
    """For a layout whose tensors tile its allocation without gaps: their byte sizes in storage
    order, each tensor's place in that order, and the allocation's bytes; else None."""
    order = sorted(range(len(layout)), key=lambda index: layout[index][0])
    sizes, end = [], 0
    for index in order:
        offset, n, dtype = layout[index]
        if offset != end:
            return None
        sizes.append(n * dtype.itemsize)
        end += sizes[-1]
    return sizes, [order.index(index) for index in range(len(layout))], end


def one_allocation(layout: Layout, device) -> tuple[torch.Tensor, ...]:
    """A pack's tensors as views of one new allocation (one ``torch.empty``, one block a pack
    for the caching allocator)."""
    plan = _split_plan(layout)
    size = plan[2] if plan is not None else allocation_bytes(layout)
    return views_of(torch.empty(size, dtype=torch.uint8, device=device), layout)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (each < 2**bits, bits in 1..8) into ``ceil(n*bits/8)`` bytes."""
    n = codes.numel()
    codes = codes.reshape(-1)
    out = torch.empty((n + 7) // 8 * bits, dtype=torch.uint8, device=codes.device)
    flat = torch.zeros(min(n, CHUNK) + 8, dtype=torch.float32, device=codes.device)
    for start in range(0, n, CHUNK):  # CHUNK is a multiple of 8: chunks start on whole bytes
        stop = min(n, start + CHUNK)
        padded = (stop - start + 7) // 8 * 8
        flat[padded - 8 : padded] = 0  # a short last chunk packs zeros after its codes
        flat[: stop - start] = codes[start:stop]
        pack_into(
            flat[:padded], bits, out[start // 8 * bits : start // 8 * bits + padded // 8 * bits]
        )
    return out[: packed_nbytes(n, bits)]


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``numel`` uint8 codes."""
    groups = (numel + 7) // 8
    data = torch.zeros(groups * bits, dtype=torch.uint8, device=packed.device)
    data[: packed.numel()] = packed
    if bits in (1, 2, 3, 4, 8):
        table, index_of = _code_table(bits, packed.device)
        return table.index_select(0, index_of(data)).view(-1)[:numel]
    words = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    words[:, :bits] = data.view(groups, bits)
    words = words.view(torch.int64).view(-1, 1)
    shifts = torch.arange(8, device=packed.device) * bits
    return ((words >> shifts) & (2**bits - 1)).to(torch.uint8).view(-1)[:numel]


def pack_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack a multiple-of-8 run of fp32 codes into ``out``. Integer shifts, not a float
    product: autocast would run a product in bf16, whose 8-bit mantissa cannot hold a 3-bit
    word's 24 bits."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8 for packing, got {bits}")
    words = _packed_words(codes, bits)
    out.view(-1, bits).copy_(words.view(torch.uint8).view(words.numel(), -1)[:, :bits])


def _packed_words(codes, bits: int):
    """Words of ``codes`` (integers in uint8 or fp32, a multiple of 8) holding code ``j`` of each
    8 at bit ``j*bits``: int32 up to 3 bits, int64 above (sign bits wrap, the bytes are what
    count)."""
    c = codes.view(-1, 8).to(torch.int32 if bits <= 3 else torch.int64)
    word = c[:, 0]
    for j in range(1, 8):
        word = word | (c[:, j] << (bits * j))
    return word


def pack_uint8_codes_into(codes, bits, packed, start, compiled) -> None:
    """Pack uint8 ``codes`` (a multiple of 8) of elements ``start...`` (a multiple of 8) into
    ``packed``, which ends at the last real code's byte."""
    words = run(compiled, _packed_words, (bits,), codes, bits)
    low_bytes = words.view(torch.uint8).view(words.numel(), -1)[:, :bits]
    byte_start = start * bits // 8
    whole_groups = min(words.numel(), (packed.numel() - byte_start) // bits)
    # Straight into place (no full-size copy in between); a partial last group byte by byte.
    end = byte_start + whole_groups * bits
    packed[byte_start:end].view(whole_groups, bits).copy_(low_bytes[:whole_groups])
    if whole_groups < words.numel():
        packed[end:] = low_bytes[whole_groups].reshape(-1)[: packed.numel() - end]


def pack_chunk_into(codes: torch.Tensor, bits: int, packed: torch.Tensor, start: int) -> None:
    """Pack fp32 ``codes`` of elements ``start...`` (start a multiple of 8) into ``packed``."""
    m = codes.numel()
    byte_start, nbytes = start * bits // 8, packed_nbytes(m, bits)
    if m % 8 == 0:
        pack_into(codes, bits, packed[byte_start : byte_start + nbytes])
        return
    padded = pad_to(codes, (m + 7) // 8 * 8, 0.0)
    tail = torch.empty(padded.numel() * bits // 8, dtype=torch.uint8, device=codes.device)
    pack_into(padded, bits, tail)
    packed[byte_start : byte_start + nbytes] = tail[:nbytes]


def pad_to(chunk: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    if chunk.numel() == size:
        return chunk
    out = torch.full((size,), fill, dtype=chunk.dtype, device=chunk.device)
    out[: chunk.numel()] = chunk
    return out


def divided(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` rounded as IEEE division on every device, as the kernels divide
    (``tl.math.div_rn``). PyTorch's CUDA kernels divide by a Python number as
    ``x * (1 / divisor)``, a bit off for most divisors: on a GPU the twins then disagreed with
    the kernels (the first lent H200: AQ bf16 and SmaQ codes one step apart). A 0-dim tensor
    on the same device is divided by."""
    if x.device.type == "cpu":
        return x / divisor
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def expanded_lookup(lut: torch.Tensor, bits: int):
    """A table of levels per packed index, and how to index it from packed bytes.

    Decoding byte by byte (or 12 bits at a time for 3-bit codes, which straddle bytes) turns
    unpacking and the level lookup into one row gather.
    """
    codes, index_of = _code_table(bits, lut.device)
    return lut[codes.long()], index_of


@functools.lru_cache(maxsize=32)
def _code_table(bits: int, device: torch.device):
    """The uint8 codes each packed index holds (one byte, or 12 bits for 3-bit codes), cached:
    this runs on every unpack (uint8 so that the cache stays at 16 KiB)."""
    if bits in (1, 2, 4, 8):
        per_byte = 8 // bits
        index = torch.arange(256, device=device)
        shifts = torch.arange(per_byte, device=device) * bits
        return ((index[:, None] >> shifts) & (2**bits - 1)).to(torch.uint8), _byte_index
    if bits == 3:
        index = torch.arange(4096, device=device)
        shifts = torch.arange(4, device=device) * 3
        return ((index[:, None] >> shifts) & 7).to(torch.uint8), _twelve_bit_index
    raise ValueError(f"bits must be one of 1, 2, 3, 4, 8 for unpacking, got {bits}")


def _byte_index(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.to(torch.int32)


def _twelve_bit_index(chunk: torch.Tensor) -> torch.Tensor:
    word = little_endian_words(chunk.view(-1, 3))
    return torch.stack([word & 0xFFF, word >> 12], dim=1).view(-1)


def little_endian_words(byte_rows: torch.Tensor) -> torch.Tensor:
    """Each row of up to 4 packed bytes as one int32, first byte lowest: the bit order the
    packers write. A fourth byte's top bit lands in the sign bit, so callers mask the fields
    they shift out."""
    b = byte_rows.to(torch.int32)
    word = b[:, 0]
    for j in range(1, b.shape[1]):
        word = word | (b[:, j] << (8 * j))
    return word


# fp32 elements a chunked twin materialises at a time (16 MiB): bounds the transients of the
# norms' forward and backward and the dropout twin's random draws on any input, where one
# full-size fp32 copy of a bf16 activation would be twice its size.
CHUNK_ELEMENTS = 1 << 22


def row_chunks(n_rows: int, width: int, budget: int = CHUNK_ELEMENTS):
    """Slices of consecutive rows holding at most ``budget`` elements (at least one row)."""
    step = max(1, budget // max(width, 1))
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]
