"""Triton helpers shared by the kernels, and Triton itself where it is installed.

Bit layout (as in ``packing.py``): code ``i`` of width ``b`` occupies bits ``[i*b, (i+1)*b)``
of a little-endian stream, so 8 codes fill ``b`` whole bytes.

Without Triton (a CPU install) the kernels are still defined, as plain functions that nothing
launches: each op file holds its twin and its kernel, and the twins must import everywhere.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def jit(fn=None, **options):
    """``triton.jit``, or the function itself where Triton is not installed."""
    if triton is None:
        return fn if fn is not None else (lambda function: function)
    return triton.jit(fn, **options) if fn is not None else triton.jit(**options)


# Compile options of every launch: no FMA contraction, so a GPU rounds each product and sum as the
# twins and the interpreter do (codes and values must match them bit for bit). The kernels are
# memory-bound; fusion would buy nothing measurable. Divisions that decide codes or values use
# tl.math.div_rn: Triton's fp32 `/` is div.full.f32 (up to 2 ulp off) on NVIDIA GPUs.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Integer arguments that must stay runtime values: Triton turns an int argument equal to 1 into a
# compile-time constant, on which the kernels' `.to(...)` fails (bits=1, group=1), and each
# value would be its own compilation that ahead-of-time compilation never saw.


@jit
def store_packed(packed_ptr, group, code, bits, n_bytes):
    """Store ``code`` ([G, 8] integers < 2**bits, bits <= 8) of 8-element groups ``group``."""
    lane = tl.arange(0, 8)
    word = tl.sum(code.to(tl.uint64) << (lane[None, :] * bits).to(tl.uint64), axis=1)
    byte_offsets = group[:, None] * bits + lane[None, :]
    values = (word[:, None] >> (lane[None, :] * 8).to(tl.uint64)) & 0xFF
    byte_mask = (lane[None, :] < bits) & (byte_offsets < n_bytes)
    tl.store(packed_ptr + byte_offsets, values.to(tl.uint8), mask=byte_mask)


@jit
def load_codes(packed_ptr, offsets, mask, bits, n_bytes):
    """The codes of elements ``offsets`` (int64); a code can straddle two bytes."""
    bit_pos = offsets * bits
    byte_pos = bit_pos >> 3
    shift = (bit_pos & 7).to(tl.int32)
    low = tl.load(packed_ptr + byte_pos, mask=mask, other=0).to(tl.int32)
    straddles = mask & (shift + bits > 8) & (byte_pos + 1 < n_bytes)
    high = tl.load(packed_ptr + byte_pos + 1, mask=straddles, other=0).to(tl.int32)
    return ((low | (high << 8)) >> shift) & ((1 << bits) - 1)


@jit
def to_dtype(v, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even.

    bf16 is rounded by hand because the Triton interpreter's fp32 -> bf16 cast truncates, and the
    kernels must round identically under the interpreter (where the tests run) and on a GPU.
    """
    if tl.bfloat16 == DTYPE:
        raw = v.to(tl.uint32, bitcast=True)
        rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)  # keep NaN a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)
