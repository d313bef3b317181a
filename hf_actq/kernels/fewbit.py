"""Few-bit activations: ``hf_actq::fewbit_codes`` (bucket search + bit packing) and
``hf_actq::fewbit_backward`` (unpack + table lookup + multiply), each a PyTorch twin and a Triton
kernel. The kernels' packed codes are bit-identical to the twins' (same fp32 comparisons, same
layout).

The ops ask for the codes alone and take the activation's value from PyTorch: on a GPU, Triton's
transcendentals differ from PyTorch's in the last bits (seen on an H100), and the forward is
promised exact. With ``output=True`` (the kernel tests) the fused forward also computes the
activation, in fp32 with Triton math. Transcendentals are written with ``tl.math`` primitives only
(``libdevice`` does not run under the Triton interpreter, where the tests run), using Kahan's forms
of expm1/log1p so that tanh, ELU and softplus stay accurate near 0. HF's formula activations
(gelu_new, gelu_fast, quick_gelu, ...) round to the input dtype after every op, as the eager
PyTorch expression does, so half-precision outputs follow the same rounding path.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from hf_actq.fewbit.activations import get_activation
from hf_actq.kernels.compiled import run, use_compiled
from hf_actq.kernels.packing import (
    CHUNK,
    COMPILED_CHUNK,
    expanded_lookup,
    little_endian_words,
    pack_into,
    pack_uint8_codes_into,
    packed_nbytes,
)
from hf_actq.kernels.registry import FLOATS, register
from hf_actq.kernels.triton_common import (
    LAUNCH_OPTIONS,
    cdiv,
    jit,
    load_codes,
    store_packed,
    tl,
    to_dtype,
)

# constexpr id of each activation's Triton forward.
ACTIVATION_IDS = {
    "gelu": 0,
    "gelu_python": 1,
    "gelu_tanh": 2,
    "gelu_new": 3,
    "gelu_fast": 4,
    "gelu_python_tanh": 5,
    "gelu_accurate": 6,
    "quick_gelu": 7,
    "silu": 8,
    "sigmoid": 9,
    "tanh": 10,
    "selu": 11,
    "softplus": 12,
    "mish": 13,
    "elu": 14,
    "celu": 15,
    "hardswish": 16,
    "relu": 17,
    "leaky_relu": 18,
    "relu6": 19,
    "hardtanh": 20,
    "hardsigmoid": 21,
}
CODE_MODES = {"table": 0, "symmetric": 1, "threshold": 2, "interval": 3}

FORWARD_GROUPS = 256  # 8 elements per group: 2048 elements per program
BACKWARD_BLOCK = 2048


def fewbit_forward_reference(
    x: torch.Tensor,
    activation: str,
    borders: torch.Tensor,
    bits: int,
    params: tuple[float, ...] = (),
    output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Activation output (None with ``output=False``), packed ``bits``-bit codes and a NaN flag,
    in one call.

    ``borders`` (fp32) are the table's interior cut points, or ``(lo, hi)`` for activations whose
    derivative takes two values. Returns ``y`` (exactly ``activation``'s PyTorch output),
    ``packed`` (uint8, ``ceil(n*bits/8)`` bytes) and ``nan_flag`` (int32 of shape (1,), non-zero
    when ``x`` holds a NaN: codes cannot say where, so backward then yields NaN gradients rather
    than silently finite ones).
    """
    spec = get_activation(activation)
    y = spec.forward(x, **dict(zip(spec.params, params))) if output else None
    n = x.numel()
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    flat = x.reshape(-1)
    cuts = tuple(borders.tolist())
    if use_compiled(flat):
        # Comparisons and packing fused by the compiler: a few passes instead of a dozen.
        nan_seen = torch.zeros(1, dtype=torch.bool, device=x.device)
        key = (x.dtype, cuts, spec.code_mode, bits)
        for start in range(0, n, COMPILED_CHUNK):
            part = flat[start : start + COMPILED_CHUNK]
            m = part.numel()
            if m % 8:
                part = torch.cat([part, part.new_zeros(8 - m % 8)])
            nan_seen |= torch.isnan(part.max())
            codes = run(True, _chunk_codes, key, part, cuts, spec.code_mode)
            codes[m:] = 0  # as the eager path packs the tail
            pack_uint8_codes_into(codes, bits, packed, start, True)
        return y, packed, nan_seen.to(torch.int32)
    lut = None
    if spec.code_mode in ("table", "symmetric"):
        lut = code_lookup_table(cuts, spec.code_mode == "symmetric", x.dtype, x.device)
    nan_seen = torch.zeros(1, dtype=torch.bool, device=x.device)
    codes = torch.zeros(min(n, CHUNK) + 8, dtype=torch.float32, device=x.device)
    hits = torch.empty(min(n, CHUNK), dtype=torch.float32, device=x.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = stop - start
        part = flat[start:stop]
        # max() propagates NaN, so one cheap reduction over cached data finds any NaN.
        nan_seen |= torch.isnan(part.max())
        c = codes[:m]
        if lut is not None:
            torch.index_select(lut, 0, _top16_bits(part), out=c)
        else:
            # Compare in fp32 as the Triton kernel does: a Python scalar against a bf16 tensor
            # would be rounded to bf16 first and move the border.
            v = part.float()
            torch.gt(v, cuts[0], out=c)
            if spec.code_mode == "interval":
                torch.lt(v, cuts[1], out=hits[:m])
                c.mul_(hits[:m])
        padded = (m + 7) // 8 * 8
        codes[m:padded] = 0
        byte_start, nbytes = start * bits // 8, packed_nbytes(m, bits)
        if padded == m:
            pack_into(codes[:padded], bits, packed[byte_start : byte_start + nbytes])
        else:
            tail = torch.empty(padded * bits // 8, dtype=torch.uint8, device=x.device)
            pack_into(codes[:padded], bits, tail)
            packed[byte_start : byte_start + nbytes] = tail[:nbytes]
    return y, packed, nan_seen.to(torch.int32)


def _chunk_codes(part, cuts: tuple, code_mode: str):
    """uint8 codes of ``part``: the comparisons that :func:`code_lookup_table` tabulates (on the
    top 16 bits of the fp32 value for "table" and "symmetric", on the fp32 value otherwise),
    written out for the compiler. Counted in fp32: inductor's uint8 additions do not vectorize.
    """
    v = part.float()
    if code_mode in ("table", "symmetric"):
        v = (v.view(torch.int32) & -65536).view(torch.float32)
        if code_mode == "symmetric":
            v = v.abs()
    codes = torch.where(v > cuts[0], 1.0, 0.0)
    if code_mode == "interval":
        codes = torch.where(v < cuts[1], codes, 0.0)
    elif code_mode in ("table", "symmetric"):
        for cut in cuts[1:]:
            codes = codes + torch.where(v > cut, 1.0, 0.0)
    return codes.to(torch.uint8)


@functools.lru_cache(maxsize=64)
def code_lookup_table(
    cuts: tuple[float, ...], symmetric: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The code of every 16-bit pattern: ``x``'s top 16 bits for fp32 (bf16 truncation), the
    whole value for bf16 and fp16. Exactly the Triton kernel's comparisons, one lookup each."""
    patterns = np.arange(65536, dtype=np.uint32)
    if dtype == torch.float16:
        values = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
        values = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    else:
        values = (patterns << np.uint32(16)).view(np.float32)
    if symmetric:
        values = np.abs(values)
    with np.errstate(invalid="ignore"):
        codes = (values[:, None] > np.asarray(cuts, dtype=np.float32)[None, :]).sum(axis=1)
    return torch.from_numpy(codes.astype(np.float32)).to(device)


def _top16_bits(part: torch.Tensor) -> torch.Tensor:
    """int32 index of each element's 16-bit pattern (see :func:`code_lookup_table`)."""
    if part.dtype in (torch.bfloat16, torch.float16):
        return part.view(torch.uint16).to(torch.int32)
    if part.dtype != torch.float32:
        part = part.float()
    return part.view(torch.uint16)[1::2].to(torch.int32)  # the high half, little-endian


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
    if use_compiled(flat) and n % 8 == 0:
        # Unpacking, the level lookup and the product fused by the compiler into one pass that
        # writes the result and nothing else (about half the eager time on a tiny LLaMA's MLP).
        # A ragged tail (rare: activations hold whole groups of eight) stays eager.
        groups = packed.view(-1, bits)
        key = (grad_y.dtype, bits)
        return run(True, _groups_backward, key, flat, groups, lut, bits).view(grad_y.shape)
    out = torch.empty(n, dtype=grad_y.dtype, device=grad_y.device)
    expanded, index_of = expanded_lookup(lut, bits)
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


def _groups_backward(grad_y, groups, lut, bits: int):
    """``grad_y * lut[code]`` for whole groups of eight codes (``groups``: ``bits`` bytes each),
    written out for the compiler. Up to eight levels are a chain of selects, which vectorizes
    where a gather does not; sixteen selects cost more than the gather."""
    word = little_endian_words(groups)
    shifts = torch.arange(8, device=grad_y.device, dtype=torch.int32) * bits
    codes = (word[:, None] >> shifts) & (2**bits - 1)
    if bits == 4:
        level = lut[codes]
    else:
        level = torch.where(codes == 1, lut[1], lut[0])
        for code in range(2, 2**bits):
            level = torch.where(codes == code, lut[code], level)
    return (grad_y.view(-1, 8).float() * level).to(grad_y.dtype).view(-1)


@jit
def _expm1(x):
    # Kahan: (u - 1) * x / log(u) cancels the rounding error of u = exp(x).
    u = tl.exp(x)
    um1 = u - 1.0
    safe = tl.where((um1 == 0.0) | (u == float("inf")), 1.0, um1)
    kahan = safe * x / tl.log(tl.where(um1 == 0.0, 2.0, u))
    out = tl.where(um1 == 0.0, x, kahan)
    out = tl.where(um1 == -1.0, -1.0, out)
    return tl.where(u == float("inf"), float("inf"), out)


@jit
def _log1p(x):
    u = 1.0 + x
    um1 = u - 1.0
    safe = tl.where(um1 == 0.0, 1.0, um1)
    out = tl.where(um1 == 0.0, x, tl.log(u) * x / safe)
    return tl.where(u == float("inf"), float("inf"), out)


@jit
def _tanh(x):
    a = tl.abs(x)
    e = _expm1(2.0 * tl.minimum(a, 20.0))
    t = tl.where(a > 20.0, 1.0, e / (e + 2.0))
    return tl.where(x < 0.0, -t, t)


@jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@jit
def _rnd(v, DTYPE: tl.constexpr):
    # Round to the input dtype, as each op of an eager half-precision expression does.
    return to_dtype(v, DTYPE).to(tl.float32)


@jit
def _activation(x, p0, p1, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr):
    if ACTIVATION == 0:  # F.gelu
        y = x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 1:  # HF gelu_python: x * 0.5 * (1 + erf(x / sqrt(2)))
        h = _rnd(x * 0.5, DTYPE)
        e = _rnd(tl.math.erf(_rnd(x / 1.4142135623730951, DTYPE)), DTYPE)
        y = h * _rnd(1.0 + e, DTYPE)
    elif ACTIVATION == 2:  # F.gelu(approximate="tanh")
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (1.0 + _tanh(inner))
    elif ACTIVATION == 3 or ACTIVATION == 6:  # HF gelu_new / gelu_accurate
        cube = _rnd(x * x * x, DTYPE)
        inner = _rnd(x + _rnd(0.044715 * cube, DTYPE), DTYPE)
        t = _rnd(_tanh(_rnd(0.7978845608028654 * inner, DTYPE)), DTYPE)
        y = _rnd(0.5 * x, DTYPE) * _rnd(1.0 + t, DTYPE)
    elif ACTIVATION == 4:  # HF gelu_fast
        a = _rnd(
            _rnd(x * 0.7978845608, DTYPE)
            * _rnd(1.0 + _rnd(_rnd(0.044715 * x, DTYPE) * x, DTYPE), DTYPE),
            DTYPE,
        )
        y = _rnd(0.5 * x, DTYPE) * _rnd(1.0 + _rnd(_tanh(a), DTYPE), DTYPE)
    elif ACTIVATION == 5:  # HF gelu_python_tanh
        cube = _rnd(x * x * x, DTYPE)
        inner = _rnd(x + _rnd(0.044715 * cube, DTYPE), DTYPE)
        t = _rnd(_tanh(_rnd(0.7978845608028654 * inner, DTYPE)), DTYPE)
        y = _rnd(x * 0.5, DTYPE) * _rnd(1.0 + t, DTYPE)
    elif ACTIVATION == 7:  # HF quick_gelu: x * sigmoid(1.702 x)
        y = x * _rnd(_sigmoid(_rnd(1.702 * x, DTYPE)), DTYPE)
    elif ACTIVATION == 8:  # silu
        y = x / (1.0 + tl.exp(-x))
    elif ACTIVATION == 9:  # sigmoid
        y = _sigmoid(x)
    elif ACTIVATION == 10:  # tanh
        y = _tanh(x)
    elif ACTIVATION == 11:  # selu
        y = tl.where(x > 0.0, 1.0507009873554805 * x, 1.7580993408473766 * _expm1(x))
    elif ACTIVATION == 12:  # softplus(beta=p0, threshold=p1)
        bx = x * p0
        y = tl.where(bx > p1, x, _log1p(tl.exp(bx)) / p0)
    elif ACTIVATION == 13:  # mish
        y = x * _tanh(_log1p(tl.exp(x)))
    elif ACTIVATION == 14:  # elu(alpha=p0)
        y = tl.where(x > 0.0, x, p0 * _expm1(x))
    elif ACTIVATION == 15:  # celu(alpha=p0)
        y = tl.where(x > 0.0, x, p0 * _expm1(x / p0))
    elif ACTIVATION == 16:  # hardswish
        y = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    elif ACTIVATION == 17:  # relu (NaN stays NaN)
        y = tl.where(x < 0.0, 0.0, x)
    elif ACTIVATION == 18:  # leaky_relu(negative_slope=p0)
        y = tl.where(x > 0.0, x, x * p0)
    elif ACTIVATION == 19:  # relu6
        y = tl.where(x < 0.0, 0.0, tl.where(x > 6.0, 6.0, x))
    elif ACTIVATION == 20:  # hardtanh(min_val=p0, max_val=p1)
        y = tl.where(x < p0, p0, tl.where(x > p1, p1, x))
    else:  # hardsigmoid
        y = tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    return y


@jit(do_not_specialize=["num_borders", "bits"])
def fewbit_forward_kernel(
    x_ptr,
    y_ptr,
    packed_ptr,
    borders_ptr,
    nan_flag_ptr,
    n_elements,
    n_bytes,
    num_borders,
    bits,
    p0,
    p1,
    ACTIVATION: tl.constexpr,
    CODE_MODE: tl.constexpr,
    GROUPS: tl.constexpr,
    STORE_OUTPUT: tl.constexpr,
):
    # Each program owns GROUPS groups of 8 elements; a group's 8 codes fill exactly `bits` bytes.
    group = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, 8)
    offsets = group[:, None] * 8 + lane[None, :]
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    if STORE_OUTPUT:
        y = _activation(x, p0, p1, ACTIVATION, x_ptr.dtype.element_ty)
        tl.store(y_ptr + offsets, to_dtype(y, y_ptr.dtype.element_ty), mask=mask)

    if CODE_MODE == 3:
        code = ((x > tl.load(borders_ptr)) & (x < tl.load(borders_ptr + 1))).to(tl.uint32)
    elif CODE_MODE == 2:
        code = (x > tl.load(borders_ptr)).to(tl.uint32)
    else:
        # DP tables compare x truncated to bf16 precision (see hf_actq.fewbit.activations).
        v = (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
        if CODE_MODE == 1:
            v = tl.abs(v)
        code = tl.zeros([GROUPS, 8], dtype=tl.uint32)
        for i in range(num_borders):
            code += (v > tl.load(borders_ptr + i)).to(tl.uint32)
    code = tl.where(mask, code, 0)
    store_packed(packed_ptr, group, code, bits, n_bytes)

    has_nan = tl.max(((x != x) & mask).to(tl.int32))
    tl.atomic_max(nan_flag_ptr, has_nan, mask=has_nan > 0)


@jit(do_not_specialize=["bits"])
def fewbit_backward_kernel(
    grad_ptr,
    packed_ptr,
    levels_ptr,
    nan_flag_ptr,
    out_ptr,
    n_elements,
    n_bytes,
    bits,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    code = load_codes(packed_ptr, offsets, mask, bits, n_bytes)
    level = tl.load(levels_ptr + code, mask=mask, other=0.0)
    level = tl.where(tl.load(nan_flag_ptr) != 0, float("nan"), level)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, to_dtype(grad * level, out_ptr.dtype.element_ty), mask=mask)


def fewbit_forward_triton(
    x: torch.Tensor,
    activation: str,
    borders: torch.Tensor,
    bits: int,
    params: tuple[float, ...] = (),
    output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The Triton side of :func:`fewbit_forward_reference`."""
    spec = get_activation(activation)
    x = x.contiguous()
    n = x.numel()
    y = torch.empty_like(x) if output else x  # codes only: y_ptr is never written
    n_bytes = packed_nbytes(n, bits)
    packed = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    nan_flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    p0, p1 = (tuple(float(p) for p in params) + (0.0, 0.0))[:2]
    if n:
        grid = (cdiv(n, 8 * FORWARD_GROUPS),)
        fewbit_forward_kernel[grid](
            x,
            y,
            packed,
            borders,
            nan_flag,
            n,
            n_bytes,
            borders.numel(),
            bits,
            p0,
            p1,
            # Codes only: one compiled variant per code mode, whatever the activation.
            ACTIVATION=ACTIVATION_IDS[spec.name] if output else 0,
            CODE_MODE=CODE_MODES[spec.code_mode],
            GROUPS=FORWARD_GROUPS,
            STORE_OUTPUT=output,
            **LAUNCH_OPTIONS,
        )
    return (y if output else None), packed, nan_flag


def fewbit_backward_triton(
    grad_y: torch.Tensor,
    packed: torch.Tensor,
    levels: torch.Tensor,
    nan_flag: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    """The Triton side of :func:`fewbit_backward_reference`."""
    grad_y = grad_y.contiguous()
    n = grad_y.numel()
    out = torch.empty_like(grad_y)
    if n:
        grid = (cdiv(n, BACKWARD_BLOCK),)
        fewbit_backward_kernel[grid](
            grad_y,
            packed,
            levels,
            nan_flag,
            out,
            n,
            packed.numel(),
            bits,
            BLOCK=BACKWARD_BLOCK,
            **LAUNCH_OPTIONS,
        )
    return out


def fewbit_codes_reference(
    x: torch.Tensor, activation: str, borders: torch.Tensor, bits: int, params: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed codes and NaN flag of :func:`fewbit_forward_reference`, without the output:
    what the ops save (the activation's value comes from PyTorch, exact)."""
    _, packed, nan_flag = fewbit_forward_reference(x, activation, borders, bits, params, False)
    return packed, nan_flag


def _fewbit_codes_triton(x, activation, borders, bits, params):
    _, packed, nan_flag = fewbit_forward_triton(x, activation, borders, bits, params, False)
    return packed, nan_flag


fewbit_codes = register(
    "fewbit_codes",
    fewbit_codes_reference,
    _fewbit_codes_triton,
    fake=lambda x, activation, borders, bits, params: (
        x.new_empty(packed_nbytes(x.numel(), bits), dtype=torch.uint8),
        x.new_empty(1, dtype=torch.int32),
    ),
    takes=lambda x, *_: x.dtype in FLOATS,
)
fewbit_backward = register(
    "fewbit_backward",
    fewbit_backward_reference,
    fewbit_backward_triton,
    fake=lambda grad_y, *_: torch.empty_like(grad_y, memory_format=torch.contiguous_format),
    takes=lambda grad_y, *_: grad_y.dtype in FLOATS,
)
