"""Few-bit activations: ``hf_actq::fewbit_forward`` (the activation's output, its bucket codes
packed, a NaN flag) and ``hf_actq::fewbit_backward`` (unpack + table lookup + multiply), each a
PyTorch twin and a Triton kernel. The kernels' packed codes are bit-identical to the twins' (same
fp32 comparisons, same layout).

The forward is promised exact: its output is PyTorch's, bit for bit. On a GPU one kernel reads x
once and writes both the output and the codes, computing the output as PyTorch's CUDA kernel does
(the same formula and CUDA math library functions, through Triton's libdevice). Whether that
matches is checked, not assumed: the first call per activation, dtype and device compares the
kernel with PyTorch on every 16-bit value (and 0.6 Mi fp32 values); where any differ, PyTorch
computes the output and the kernel only the codes (:func:`exact_forward_options`).

Under the Triton interpreter (the tests, on CPU), where libdevice does not run, the kernel's own
output is computed with ``tl.math`` primitives (:func:`_activation`), Kahan's forms of expm1/log1p
keeping tanh, ELU and softplus accurate near 0. HF's formula activations (gelu_new, gelu_fast,
quick_gelu, ...) round to the input dtype after every op, as the eager PyTorch expression does.
"""

from __future__ import annotations

import functools
import logging
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
    TILE_ELEMENTS,
    cdiv,
    jit,
    libdevice,
    pack_tile,
    tile,
    tl,
    to_dtype,
    unpack_tile,
)

logger = logging.getLogger("hf_actq")

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

ROWS = TILE_ELEMENTS // 256  # rows of 256 elements a program handles


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


@jit
def _pytorch_cuda_activation(x, p0, p1, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr):
    """The activation as PyTorch's CUDA kernel computes it (same fp32 formula, same CUDA math
    library functions, IEEE division): what the fused forward computes on a GPU, where its
    output must equal PyTorch's bit for bit (``exact_forward_options`` checks that it does
    before any op uses it). Activations without transcendentals as :func:`_activation`."""
    if ACTIVATION == 0:  # F.gelu: ActivationGeluKernel.cu
        y = x * 0.5 * (1.0 + libdevice.erf(x * 0.7071067811865476))
    elif ACTIVATION == 2:  # F.gelu(approximate="tanh"): nvcc contracts x + kKappa * x^3
        inner = 0.7978845608028654 * tl.fma(0.044715, x * x * x, x)
        y = 0.5 * x * (1.0 + libdevice.tanh(inner))
    elif ACTIVATION == 3 or ACTIVATION == 6:  # HF gelu_new / gelu_accurate
        # One PyTorch op at a time, each rounded to the dtype; ATen's pow(x, 3) multiplies in
        # the dtype (base * base * base: two roundings in half precision).
        cube = _rnd(_rnd(x * x, DTYPE) * x, DTYPE)
        inner = _rnd(x + _rnd(0.044715 * cube, DTYPE), DTYPE)
        t = _rnd(libdevice.tanh(_rnd(0.7978845608028654 * inner, DTYPE)), DTYPE)
        y = _rnd(0.5 * x, DTYPE) * _rnd(1.0 + t, DTYPE)
    elif ACTIVATION == 8:  # F.silu: ActivationSiluKernel.cu
        y = libdevice.div_rn(x, 1.0 + libdevice.exp(-x))
    elif ACTIVATION == 9:  # torch.sigmoid: 1 / d rounded once is the reciprocal rounded once
        y = libdevice.rcp_rn(1.0 + libdevice.exp(-x))
    elif ACTIVATION == 10:  # torch.tanh
        y = libdevice.tanh(x)
    else:
        y = _activation(x, p0, p1, ACTIVATION, DTYPE)
    return y


@jit
def activation_value(
    x, p0, p1, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr, LIBDEVICE: tl.constexpr
):
    """The activation of fp32 ``x``: PyTorch's CUDA formula through libdevice (a GPU), or
    Triton math (the interpreter)."""
    if LIBDEVICE:
        y = _pytorch_cuda_activation(x, p0, p1, ACTIVATION, DTYPE)
    else:
        y = _activation(x, p0, p1, ACTIVATION, DTYPE)
    return y


@jit
def fewbit_forward_kernel(
    x_ptr,
    y_ptr,
    packed_ptr,
    borders_ptr,
    nan_flag_ptr,
    n_elements,
    n_bytes,
    p0,
    p1,
    ACTIVATION: tl.constexpr,
    CODE_MODE: tl.constexpr,
    NUM_BORDERS: tl.constexpr,
    BITS: tl.constexpr,
    STORE_OUTPUT: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    ROWS: tl.constexpr,
):
    # ROWS x 256 consecutive elements a program (32 a thread, 128-bit loads); the width a
    # constant, so the codes pack inside each thread with shifts (as the codecs' kernels).
    first, count, local = tile(n_elements, ROWS, 256)
    valid = local < count
    x = tl.load(x_ptr + first + local, mask=valid, other=0.0).to(tl.float32)

    if STORE_OUTPUT:
        y = activation_value(x, p0, p1, ACTIVATION, x_ptr.dtype.element_ty, LIBDEVICE)
        tl.store(y_ptr + first + local, to_dtype(y, y_ptr.dtype.element_ty), mask=valid)

    store_codes(x, valid, first, local, borders_ptr, packed_ptr, nan_flag_ptr, n_bytes,
                CODE_MODE, NUM_BORDERS, BITS, ROWS)  # fmt: skip


@jit
def store_codes(
    x,
    valid,
    first,
    local,
    borders_ptr,
    packed_ptr,
    nan_flag_ptr,
    n_bytes,
    CODE_MODE: tl.constexpr,
    NUM_BORDERS: tl.constexpr,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The codes of the tile ``x`` ([ROWS, 256] fp32 from element ``first``) packed, and the
    NaN flag raised where it holds a NaN."""
    if CODE_MODE == 3:
        code = ((x > tl.load(borders_ptr)) & (x < tl.load(borders_ptr + 1))).to(tl.int32)
    elif CODE_MODE == 2:
        code = (x > tl.load(borders_ptr)).to(tl.int32)
    else:
        # DP tables compare x truncated to bf16 precision (see hf_actq.fewbit.activations).
        v = (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
        if CODE_MODE == 1:
            v = tl.abs(v)
        code = tl.zeros([ROWS, 256], dtype=tl.int32)
        for i in tl.static_range(NUM_BORDERS):  # at most 15 (4 bits): held in registers
            code += (v > tl.load(borders_ptr + i)).to(tl.int32)
    byte_start = (first >> 3) * BITS  # a tile's first element starts a whole byte
    pack_tile(
        packed_ptr + byte_start, tl.where(valid, code, 0), n_bytes - byte_start, ROWS, 256, BITS
    )

    # An atomic per NaN, none otherwise: no reduction across the program (no barriers).
    nan = valid & (x != x)
    tl.atomic_max(nan_flag_ptr + local * 0, nan.to(tl.int32), mask=nan)


@jit
def fewbit_backward_kernel(
    grad_ptr,
    packed_ptr,
    levels_ptr,
    nan_flag_ptr,
    out_ptr,
    n_elements,
    n_bytes,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    first, count, local = tile(n_elements, ROWS, 256)
    valid = local < count
    level = load_levels(first, packed_ptr, n_bytes, levels_ptr, nan_flag_ptr, BITS, ROWS)
    grad = tl.load(grad_ptr + first + local, mask=valid, other=0.0).to(tl.float32)
    out = to_dtype(grad * level, out_ptr.dtype.element_ty)
    tl.store(out_ptr + first + local, out, mask=valid)


@jit
def load_levels(
    first, packed_ptr, n_bytes, levels_ptr, nan_flag_ptr, BITS: tl.constexpr, ROWS: tl.constexpr
):
    """The derivative's level of each element of the tile from element ``first`` ([ROWS, 256]
    fp32), from its packed code; NaN everywhere where the forward saw a NaN."""
    byte_start = (first >> 3) * BITS
    code = unpack_tile(packed_ptr + byte_start, n_bytes - byte_start, ROWS, 256, BITS)
    if BITS <= 3:
        # Up to eight levels: a chain of selects on values held in registers.
        level = tl.zeros([ROWS, 256], dtype=tl.float32) + tl.load(levels_ptr)
        for i in tl.static_range(1, 1 << BITS):
            level = tl.where(code == i, tl.load(levels_ptr + i), level)
    else:
        level = tl.load(levels_ptr + code)  # 16 levels: a gather from L1, cheaper than 15 selects
    return tl.where(tl.load(nan_flag_ptr) != 0, float("nan"), level)


def fewbit_forward_triton(
    x: torch.Tensor,
    activation: str,
    borders: torch.Tensor,
    bits: int,
    params: tuple[float, ...] = (),
    output: bool = True,
    exact_options: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The Triton side of :func:`fewbit_forward_reference`. With ``exact_options`` (compile
    options from :func:`exact_forward_options`) a GPU computes the output as PyTorch's CUDA
    kernel does; otherwise, and always under the interpreter (where libdevice does not run),
    with Triton math (:func:`_activation`)."""
    spec = get_activation(activation)
    x = x.contiguous()
    n = x.numel()
    y = torch.empty_like(x) if output else x  # codes only: y_ptr is never written
    n_bytes = packed_nbytes(n, bits)
    packed = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    nan_flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    p0, p1 = (tuple(float(p) for p in params) + (0.0, 0.0))[:2]
    if n:
        fewbit_forward_kernel[(cdiv(n, TILE_ELEMENTS),)](
            x,
            y,
            packed,
            borders,
            nan_flag,
            n,
            n_bytes,
            p0,
            p1,
            # Codes only: one compiled variant per code mode and width, whatever the activation.
            ACTIVATION=ACTIVATION_IDS[spec.name] if output else 0,
            CODE_MODE=CODE_MODES[spec.code_mode],
            NUM_BORDERS=borders.numel(),
            BITS=bits,
            STORE_OUTPUT=output,
            LIBDEVICE=exact_options is not None and x.device.type == "cuda",
            ROWS=ROWS,
            **(exact_options or LAUNCH_OPTIONS),
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
        fewbit_backward_kernel[(cdiv(n, TILE_ELEMENTS),)](
            grad_y,
            packed,
            levels,
            nan_flag,
            out,
            n,
            packed.numel(),
            BITS=bits,
            ROWS=ROWS,
            **LAUNCH_OPTIONS,
        )
    return out


# Activations whose PyTorch CUDA formula the fused forward reproduces (_pytorch_cuda_activation).
FUSED_ACTIVATIONS = frozenset(
    {"gelu", "gelu_tanh", "gelu_new", "gelu_accurate", "silu", "sigmoid", "tanh"}
)
# Compile options tried for the fused forward, in order. IEEE subnormals in the math library
# (Triton flushes them by default, nvcc, with which PyTorch's kernels are built, does not); the
# contraction nvcc makes in a formula written out (tl.fma). Without contraction first: the
# kernels that also quantize (the gated product's) need it, their codes must be the twins'. With
# it second, as nvcc compiles by default. 8 warps: 16 values a thread, whose math library
# temporaries fit sm_80's registers (32 spilled).
EXACT_OPTION_CANDIDATES = (
    {"enable_fp_fusion": False, "enable_reflect_ftz": False, "num_warps": 8},
    {"enable_fp_fusion": True, "enable_reflect_ftz": False, "num_warps": 8},
)
# (activation, params, dtype, device) -> the options with which the fused forward's output equals
# PyTorch's on every probed input, or None (PyTorch computes the output, the kernel the codes).
EXACT_FORWARD: dict[tuple, dict | None] = {}
PROBE_SAMPLES = 1 << 18  # random fp32 values per kind (bit patterns, normal values): 2 MiB each
# Devices whose fused forward is probed. Under the interpreter (CPU) the kernel's output is
# Triton math, which nothing needs: CPU training runs the twins. The tests add "cpu".
PROBED_DEVICES = {"cuda"}


def probe_inputs(dtype: torch.dtype, device) -> torch.Tensor:
    """Inputs on which the fused forward must match PyTorch: every value of a 16-bit dtype; for
    fp32 every bf16 value (each exponent, subnormals, infinities, NaN), random bit patterns and
    random normal values (the range activations live in)."""
    patterns = torch.arange(65536, dtype=torch.int32, device="cpu")
    if dtype != torch.float32:
        return patterns.to(torch.int16).view(dtype).to(device)
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(
        -(2**31), 2**31, (PROBE_SAMPLES,), generator=generator, dtype=torch.int64, device="cpu"
    )
    normal = torch.randn(PROBE_SAMPLES, generator=generator, device="cpu") * 4
    values = (
        (patterns << 16).view(torch.float32),
        bits.to(torch.int32).view(torch.float32),
        normal,
    )
    return torch.cat(values).to(device)


def exact_forward_options(
    activation: str, params: tuple[float, ...], x: torch.Tensor, borders, bits: int
) -> dict | None:
    """Compile options with which the fused forward's output equals PyTorch's for ``x``'s dtype
    on ``x``'s device, or None. Decided once per activation, dtype and device, on
    :func:`probe_inputs` (a read of the device, once): a GPU whose CUDA math differs from the
    library PyTorch was built with, or a Triton that compiles the formula differently, keeps the
    forward exact by computing the output with PyTorch, at the cost of a second read of x."""
    key = (activation, params, x.dtype, x.device)
    if key not in EXACT_FORWARD:
        EXACT_FORWARD[key] = _probe_exact_forward(activation, params, x, borders, bits)
    return EXACT_FORWARD[key]


def _probe_exact_forward(activation, params, x, borders, bits) -> dict | None:
    if activation not in FUSED_ACTIVATIONS or x.device.type not in PROBED_DEVICES:
        return None
    probe = probe_inputs(x.dtype, x.device)
    spec = get_activation(activation)
    expected = spec.forward(probe, **dict(zip(spec.params, params)))
    integer = torch.int32 if x.dtype == torch.float32 else torch.int16
    for options in EXACT_OPTION_CANDIDATES:
        y, _, _ = fewbit_forward_triton(probe, activation, borders, bits, params, True, options)
        same = (y.view(integer) == expected.view(integer)) | (y.isnan() & expected.isnan())
        if bool(same.all()):
            return options
    where = (~same).nonzero()[:3, 0]
    logger.info(
        "hf_actq: the fused few-bit %s forward (%s, %s) differs from PyTorch's at x = %s "
        "(%s against %s); PyTorch computes the output and a kernel the codes.",
        activation,
        x.dtype,
        x.device,
        probe[where].tolist(),
        y[where].tolist(),
        expected[where].tolist(),
    )
    return None


def fewbit_forward_exact_reference(
    x: torch.Tensor, activation: str, borders: torch.Tensor, bits: int, params: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the ops keep and return: the activation's output exactly as PyTorch computes it,
    the packed codes and the NaN flag of :func:`fewbit_forward_reference`."""
    return fewbit_forward_reference(x, activation, borders, bits, params)


def _fewbit_forward_exact_triton(x, activation, borders, bits, params):
    options = None
    if x.is_contiguous():
        options = exact_forward_options(activation, tuple(params), x, borders, bits)
    if options is not None:  # one pass: x read once, y and the codes written
        return fewbit_forward_triton(x, activation, borders, bits, params, True, options)
    _, packed, nan_flag = fewbit_forward_triton(x, activation, borders, bits, params, False)
    spec = get_activation(activation)
    return spec.forward(x, **dict(zip(spec.params, params))), packed, nan_flag


fewbit_forward = register(
    "fewbit_forward",
    fewbit_forward_exact_reference,
    _fewbit_forward_exact_triton,
    fake=lambda x, activation, borders, bits, params: (
        torch.empty_like(x),
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
