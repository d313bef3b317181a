"""The PyTorch twins compiled by TorchInductor: the fast CPU path.

Run eagerly, a twin is a chain of torch ops, one pass over memory each (block minimum, scaling,
noise, rounding, packing: a dozen passes for one codec), and on CPU the twins are the training
path. TorchInductor fuses a twin's chunk function into one C++ loop (OpenMP threads, SIMD), which
``benchmarks/bench_speed.py`` and ``bench_fewbit.py`` measure. The same Python function runs
either way, so compiled and eager outputs are equal bit for bit (``tests/kernels/
test_compiled.py``): inductor keeps IEEE semantics on CPU (no fp contraction, no fast math).

Each (function, key) compiles once per process on first use, a few seconds, with dynamic shapes
(no recompiles per shape); inductor caches on disk, so later processes load it. Small tensors
stay eager (a compiled call's guards cost more than the passes it saves), and so does everything
when compilation is not possible (no C++ compiler: a warning says so, once) or when
``HF_ACTQ_COMPILED_TWINS=0``. A key per specialization (dtype, bits, ...) gets its own code
object: dynamo caches compiled variants per code object, eight at most.
"""

from __future__ import annotations

import functools
import logging
import os
import types
import warnings

import torch

logger = logging.getLogger(__name__)

# Elements below which a twin runs eagerly (one compiled call's guards and launch cost about
# what a few eager passes over 64 Ki fp32 elements do on 2 cores).
MIN_ELEMENTS = 1 << 16

_broken: list[str] = []  # why compilation failed, once it has


def use_compiled(tensor: torch.Tensor) -> bool:
    """Whether twins on ``tensor`` run compiled."""
    return (
        tensor.device.type == "cpu"
        and tensor.numel() >= MIN_ELEMENTS
        and not _broken
        and os.environ.get("HF_ACTQ_COMPILED_TWINS", "1") not in ("0", "")
        and not torch.compiler.is_compiling()
    )


@functools.cache
def _compiled(fn, key):
    # A distinct name too: equal code objects can share one cache.
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{abs(hash(key)):x}")
    clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    logger.info("hf_actq: compiling the CPU kernel %s%s (once per process)", fn.__name__, key)
    # Precision casts kept as eager rounds them (a bf16 mean rounded, then widened again).
    options = {"emulate_precision_casts": True}
    return torch.compile(clone, dynamic=True, fullgraph=True, options=options)


def run(compiled: bool, fn, key: tuple, *args):
    """``fn(*args)``, compiled (specialized for ``key``) when ``compiled`` and possible."""
    if compiled and not _broken:
        try:
            # Python ints (bits, group) specialize: shapes stay dynamic, shift counts constant.
            with torch.no_grad(), torch._dynamo.config.patch(specialize_int=True):
                return _compiled(fn, key)(*args)
        except Exception as error:  # noqa: BLE001 (no compiler, unsupported platform, ...)
            _broken.append(f"{type(error).__name__}: {str(error)[:300]}")
            warnings.warn(
                f"hf_actq: compiling the CPU kernels failed ({_broken[0]}); running the eager "
                "PyTorch twins, which are several times slower. Install a C++ compiler for "
                "TorchInductor, or set HF_ACTQ_COMPILED_TWINS=0 to skip the attempt.",
                stacklevel=2,
            )
    return fn(*args)


# Counter-based noise --------------------------------------------------------------------------
_GOLDEN = -1640531535  # 0x9E3779B1 as int32: spreads consecutive counters over 32 bits


def mix_seed(seed: int) -> int:
    """A seed scrambled to 32 bits, as an int32 value (the noise's stream key)."""
    value = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 29)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = (value ^ (value >> 32)) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def as_int32(value: int) -> int:
    """``value`` modulo 2**32 as a signed int32 (the noise's counters wrap)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def uniform_noise(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """fp32 noise in [0, 1) with 24 random bits, a hash of each int32 ``index`` and the int32
    stream ``key`` (lowbias32 by C. Wellons): no generator state, any chunking gives the same
    noise, and one fused pass computes it. int32 products wrap; shifts are masked to be logical.
    """
    h = index * _GOLDEN + key
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * -2073254261  # 0x846CA68B
    h = h ^ ((h >> 16) & 0xFFFF)
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))
