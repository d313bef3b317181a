"""Rotated uniform rounding (``codecs/rotated.py`` with every coefficient kept):
``hf_actq::rotated_quantize`` rotates each run of 128 values by a fixed signed Hadamard matrix
and quantizes the coefficients as AQ does with group 1; ``hf_actq::rotated_dequantize``
dequantizes them and rotates back. Each a PyTorch twin (a matrix product, then AQ's twin) and a
Triton kernel that does both in one pass: the rotation is a ``tl.dot`` of each tile in
registers, on tensor cores, so the coefficients never reach memory (the composition wrote and
read them in full, a transient the size of the tensor: about 13 bytes an element of bf16 for a
pack and an unpack, where two plain copies move 8 and these kernels 5).

The products are exact and summed in fp32, as the twin's matrix product sums them, in another
order: bf16 tiles times the bf16 matrix; fp32 tiles (fp32 and fp16 tensors) cut into three bf16
parts that sum to them exactly, times the matrix's signs, then its scale (:func:`tile_shape`). A
coefficient may differ from the twin's in its last bit, and its code by one where it sits on a
rounding boundary. Sums that are exact in any order (the tests' inputs) give the twin's codes
bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch

from hf_actq.kernels.average_quant import (
    aq_buffers,
    aq_dequantize_reference,
    aq_dequantize_triton,
    aq_quantize_reference,
    aq_quantize_tile,
    aq_quantize_triton,
    aq_values_tile,
)
from hf_actq.kernels.compiled import mix_seed
from hf_actq.kernels.packing import packed_nbytes
from hf_actq.kernels.registry import FLOATS, register, seed_beside
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    cdiv,
    jit,
    noise_stream_key,
    tile_at,
    tl,
    to_dtype,
)

ROTATION = 128
# Rows of ROTATION values the twin rotates at a time: bounds its transients to 8 MiB of fp32.
_SLAB_ROWS = 1 << 14


def coefficient_dtype(dtype: torch.dtype) -> torch.dtype:
    """The rotated coefficients' dtype: bf16 for a bf16 input (they are rounded to a few bits
    next, and it halves the twin's transient), fp32 otherwise (fp16's range is too short for
    rotated sums)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def rotated_rows(source: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The rows of ``ROTATION`` values of flat ``source`` (the last zero-padded) times
    ``rotation``, in ``rotation``'s dtype: ``[rows, ROTATION]``, a slab at a time."""
    flat = source.detach().reshape(-1)
    n, dtype = flat.numel(), rotation.dtype
    rows, whole = cdiv(n, ROTATION), n // ROTATION
    coeffs = torch.empty(rows, ROTATION, dtype=dtype, device=source.device)
    with torch.autocast(source.device.type, enabled=False):  # the operands' dtype, not autocast's
        for start in range(0, whole, _SLAB_ROWS):
            stop = min(whole, start + _SLAB_ROWS)
            slab = flat[start * ROTATION : stop * ROTATION].view(-1, ROTATION).to(dtype)
            torch.matmul(slab, rotation, out=coeffs[start:stop])
        if rows > whole:  # a last partial row, zero-padded
            tail = flat[whole * ROTATION :].to(dtype)
            tail = torch.nn.functional.pad(tail, (0, ROTATION - tail.numel()))
            coeffs[whole] = tail @ rotation
    return coeffs


def rotated_back(coeffs: torch.Tensor, rotation: torch.Tensor, shape, dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` whose rows :func:`rotated_rows` gave ``coeffs``:
    ``coeffs`` times ``rotation``'s transpose, rounded to ``dtype``."""
    n, rows = math.prod(shape), coeffs.shape[0]
    back = rotation.T
    out = torch.empty(n, dtype=dtype, device=coeffs.device)
    direct = dtype == coeffs.dtype and n % ROTATION == 0  # no cast, no partial row
    with torch.autocast(coeffs.device.type, enabled=False):
        for start in range(0, rows, _SLAB_ROWS):
            stop = min(rows, start + _SLAB_ROWS)
            piece = out[start * ROTATION : min(n, stop * ROTATION)]
            if direct:
                torch.matmul(coeffs[start:stop], back, out=piece.view(-1, ROTATION))
            else:
                piece.copy_((coeffs[start:stop] @ back).view(-1)[: piece.numel()])
    return out.view(shape)


def rotated_quantize_reference(
    source: torch.Tensor,
    rotation: torch.Tensor,
    bits: int,
    block: int,
    stochastic: bool,
    seed: int = 0,
    device_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, mins, scales)``: AQ's codes with group 1 (:func:`aq_quantize_reference`,
    whose seed arguments these are) of :func:`rotated_rows` of ``source``."""
    coeffs = rotated_rows(source, rotation).view(-1)
    return aq_quantize_reference(coeffs, 1, bits, block, stochastic, seed, device_seed)


def rotated_dequantize_reference(
    data: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    rotation: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    bits: int,
    block: int,
) -> torch.Tensor:
    """The tensor whose pack :func:`rotated_quantize_reference` made with ``rotation``: the
    coefficients dequantized in ``rotation``'s dtype, then :func:`rotated_back`."""
    coeff_shape = [cdiv(math.prod(shape), ROTATION), ROTATION]
    coeffs = aq_dequantize_reference(
        data, mins, scales, coeff_shape, rotation.dtype, bits, 1, block
    )
    return rotated_back(coeffs, rotation, shape, dtype)


def tile_shape(dtype: torch.dtype) -> tuple[int, int, dict]:
    """``(ROWS, PARTS, launch options)`` for coefficients of ``dtype``: the rows of ROTATION
    values a tile rotates (``tl.dot``'s M: 16 at least), the bf16 parts its values are cut
    into, and the warps. bf16 coefficients: 32 rows in one part over 4 warps (at most 200
    registers at sm_90, no stack). fp32 coefficients: the signs of the matrix (exact in bf16)
    times three bf16 parts of the tile, which sum to its fp32 values exactly: every product
    exact and fp32 sums, on tensor cores (an fp32 product of fp32 operands there is TF32's 11
    bits, and a SIMT one about 128 multiply-adds a value). 16 rows over 8 warps: with 32 rows,
    or 4 warps, the parts spilled registers to the stack (``tools/aot.py``)."""
    if dtype == torch.bfloat16:
        return 32, 1, LAUNCH_OPTIONS
    return 16, 3, {**LAUNCH_OPTIONS, "num_warps": 8}


def _tiles_per_program(n_tiles: int) -> int:
    """Tiles each program rotates with the matrix it loaded once (32 or 64 KiB): up to 8 on
    large tensors, where reloading it per tile would read several times the tensor's bytes
    from L2; 1 on small ones, whose few programs would leave SMs idle. Keeps at least 1,024
    programs where it loops."""
    return max(1, min(8, n_tiles // 1024))


def fused_on(device: torch.device) -> bool:
    """Whether the fused kernels run on ``device``: tensor cores that multiply bf16 (sm_80 and
    later, and the interpreter's CPU). Older GPUs (T4, V100) take the composition with the AQ
    kernels, as all did before."""
    return device.type != "cuda" or _capability(device.index) >= (8, 0)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _dot_dtype():
    """The products' operand dtype: bf16 on tensor cores; fp32 in the interpreter, which
    multiplies bf16 in ``tl.dot`` wrongly (bf16 values, so the same exact products)."""
    # Imported here: Triton imports its interpreter module only in interpreter mode.
    from triton.runtime.interpreter import InterpretedFunction

    return tl.float32 if isinstance(rotated_quantize_kernel, InterpretedFunction) else tl.bfloat16


@jit
def load_rotation(rotation_ptr, ROW_STRIDE: tl.constexpr, COLUMN_STRIDE: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
    """The 128 x 128 matrix at ``rotation_ptr`` as the products take it, and the scale after
    them: itself in DOT_DTYPE and 1 (bf16, one part), or its signs (exact in bf16) and the
    magnitude ``c`` of its ``+-c`` entries (fp32, in parts)."""
    index = tl.arange(0, 128)
    entries = tl.load(rotation_ptr + index[:, None] * ROW_STRIDE + index[None, :] * COLUMN_STRIDE)
    if PARTS == 1:
        return entries.to(DOT_DTYPE), 1.0
    else:
        signs = tl.where(entries > 0, 1.0, -1.0).to(DOT_DTYPE)
        return signs, tl.abs(tl.load(rotation_ptr).to(tl.float32))


@jit
def rotated_tile(x, rotation, scale, DOT_DTYPE: tl.constexpr, PARTS: tl.constexpr):
    """``x @ rotation * scale`` in fp32 (``x``: fp32 ``[ROWS, 128]``): in one part, or ``x`` cut
    into PARTS bf16 parts whose products with the signs are exact (fp32 sums)."""
    if PARTS == 1:
        return tl.dot(x.to(DOT_DTYPE), rotation)
    else:
        part = x.to(tl.bfloat16).to(tl.float32)
        total = tl.dot(part.to(DOT_DTYPE), rotation)
        rest = x - part  # exact: what the part's rounding left
        for _ in tl.static_range(PARTS - 1):
            part = rest.to(tl.bfloat16).to(tl.float32)
            total = tl.dot(part.to(DOT_DTYPE), rotation, total)
            rest = rest - part
        return total * scale


@jit(do_not_specialize=["noise_key", "tiles"])
def rotated_quantize_kernel(
    src_ptr,
    rotation_ptr,
    packed_ptr,
    mins_ptr,
    scales_ptr,
    n_elements,
    n_bytes,
    noise_key,
    seed_ptr,
    tiles,
    STOCHASTIC: tl.constexpr,
    SEED_IN_MEMORY: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    COLUMN_STRIDE: tl.constexpr,
    PARTS: tl.constexpr,
):
    # `tiles` consecutive tiles of ROWS x 128 elements a program, each rotated in registers by
    # the matrix loaded once, its coefficients quantized as AQ's kernel quantizes them.
    rotation, scale = load_rotation(rotation_ptr, ROW_STRIDE, COLUMN_STRIDE, DOT_DTYPE, PARTS)
    coeff_dtype = rotation_ptr.dtype.element_ty
    if STOCHASTIC:
        key = noise_stream_key(noise_key, seed_ptr, SEED_IN_MEMORY).to(tl.int32, bitcast=True)
    else:
        key = noise_key
    n_coeffs = tl.cdiv(n_elements, 128) * 128
    for t in range(tiles):
        tile_index = tl.program_id(0) * tiles + t
        first, count, element = tile_at(tile_index, n_elements, ROWS, 128)
        x = tl.load(src_ptr + first + element, mask=element < count, other=0.0)
        coeffs = rotated_tile(x.to(tl.float32), rotation, scale, DOT_DTYPE, PARTS)
        coeffs = to_dtype(coeffs, coeff_dtype).to(tl.float32)
        aq_quantize_tile(
            tl.reshape(coeffs, [ROWS * 128 // BLOCK, BLOCK]),
            tile_index,
            packed_ptr,
            mins_ptr,
            scales_ptr,
            n_coeffs,
            n_bytes,
            key,
            coeff_dtype,
            STOCHASTIC,
            BITS,
            1,
            BLOCK,
            ROWS * 128 // BLOCK,
        )


@jit(do_not_specialize=["tiles"])
def rotated_dequantize_kernel(
    packed_ptr,
    mins_ptr,
    scales_ptr,
    rotation_ptr,
    out_ptr,
    n_elements,
    n_bytes,
    tiles,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    COLUMN_STRIDE: tl.constexpr,
    PARTS: tl.constexpr,
):
    # The transpose, read with the strides swapped: rotates the coefficients back.
    back, scale = load_rotation(rotation_ptr, COLUMN_STRIDE, ROW_STRIDE, DOT_DTYPE, PARTS)
    coeff_dtype = rotation_ptr.dtype.element_ty
    n_coeffs = tl.cdiv(n_elements, 128) * 128
    for t in range(tiles):
        tile_index = tl.program_id(0) * tiles + t
        coeffs = aq_values_tile(
            tile_index,
            packed_ptr,
            mins_ptr,
            scales_ptr,
            n_coeffs,
            n_bytes,
            coeff_dtype,
            BITS,
            1,
            BLOCK,
            ROWS * 128 // BLOCK,
        )
        coeffs = tl.reshape(coeffs, [ROWS, 128]).to(tl.float32)
        value = rotated_tile(coeffs, back, scale, DOT_DTYPE, PARTS)
        value = to_dtype(to_dtype(value, coeff_dtype).to(tl.float32), out_ptr.dtype.element_ty)
        first, count, element = tile_at(tile_index, n_elements, ROWS, 128)
        tl.store(out_ptr + first + element, value, mask=element < count)


def _launch(n: int, rotation: torch.Tensor) -> tuple[tuple[int], int, dict]:
    """The grid, the tiles a program rotates and the constants and options both kernels take
    for ``n`` values and ``rotation``."""
    rows, parts, options = tile_shape(rotation.dtype)
    n_tiles = cdiv(n, rows * ROTATION)
    tiles = _tiles_per_program(n_tiles)
    constants = {"ROWS": rows, "DOT_DTYPE": _dot_dtype(), "PARTS": parts, **options}
    constants |= {"ROW_STRIDE": rotation.stride(0), "COLUMN_STRIDE": rotation.stride(1)}
    return (cdiv(n_tiles, tiles),), tiles, constants


def rotated_quantize_triton(source, rotation, bits, block, stochastic, seed=0, device_seed=None):
    """The Triton side of :func:`rotated_quantize_reference`: one launch, one allocation."""
    if not fused_on(source.device):
        coeffs = rotated_rows(source, rotation).view(-1)
        return aq_quantize_triton(coeffs, 1, bits, block, stochastic, seed, device_seed)
    source = source.contiguous()
    n = source.numel()
    packed, mins, scales = aq_buffers(cdiv(n, ROTATION) * ROTATION, bits, block, source.device)
    if n:
        grid, tiles, constants = _launch(n, rotation)
        rotated_quantize_kernel[grid](
            source,
            rotation,
            packed,
            mins,
            scales,
            n,
            packed.numel(),
            mix_seed(seed) if stochastic and device_seed is None else 0,
            source if device_seed is None else device_seed,  # an unread pointer without one
            tiles,
            STOCHASTIC=bool(stochastic),
            SEED_IN_MEMORY=bool(stochastic) and device_seed is not None,
            BITS=bits,
            BLOCK=block,
            **constants,
        )
    return packed, mins, scales


def rotated_dequantize_triton(data, mins, scales, rotation, shape, dtype, bits, block):
    """The Triton side of :func:`rotated_dequantize_reference`: one launch, one allocation."""
    n = math.prod(shape)
    if not fused_on(data.device):
        coeff_shape = [cdiv(n, ROTATION), ROTATION]
        coeffs = aq_dequantize_triton(
            data, mins, scales, coeff_shape, rotation.dtype, bits, 1, block
        )
        return rotated_back(coeffs, rotation, shape, dtype)
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if n:
        grid, tiles, constants = _launch(n, rotation)
        rotated_dequantize_kernel[grid](
            data,
            mins,
            scales,
            rotation,
            out,
            n,
            data.numel(),
            tiles,
            BITS=bits,
            BLOCK=block,
            **constants,
        )
    return out


def _rotated_quantize_fake(source, rotation, bits, block, stochastic, seed=0, device_seed=None):
    coeffs = cdiv(source.numel(), ROTATION) * ROTATION
    return (
        source.new_empty(packed_nbytes(coeffs, bits), dtype=torch.uint8),
        source.new_empty(cdiv(coeffs, block), dtype=torch.float32),
        source.new_empty(cdiv(coeffs, block), dtype=torch.float32),
    )


def _takes_rotation(rotation: torch.Tensor, dtype: torch.dtype) -> bool:
    """The rotation the kernels multiply by (a signed Hadamard matrix, entries ``+-c``: an fp32
    one is applied as its signs and ``c``): ``[128, 128]`` in the coefficients' dtype for
    ``dtype``, row- or column-major (the codec's is the transpose of a row-major matrix: the
    layout its twin's matrix products were always given, whose sums the library orders by it)."""
    return (
        dtype in FLOATS
        and rotation.shape == (ROTATION, ROTATION)
        and sorted(rotation.stride()) == [1, ROTATION]
        and rotation.dtype == coefficient_dtype(dtype)
    )


rotated_quantize = register(
    "rotated_quantize",
    rotated_quantize_reference,
    rotated_quantize_triton,
    fake=_rotated_quantize_fake,
    takes=lambda source, rotation, *args: (
        _takes_rotation(rotation, source.dtype) and seed_beside(source, *args[4:])
    ),
)
rotated_dequantize = register(
    "rotated_dequantize",
    rotated_dequantize_reference,
    rotated_dequantize_triton,
    fake=lambda data, mins, scales, rotation, shape, dtype, *_: data.new_empty(shape, dtype=dtype),
    takes=lambda data, mins, scales, rotation, shape, dtype, *_: _takes_rotation(rotation, dtype),
)
