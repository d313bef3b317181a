"""Each kernel op registered through ``torch.library``, as bitsandbytes registers its ops: the
PyTorch twin is the default implementation (CPU, any other device, and torch.compile's fake
tensors through the op's fake), and CUDA tensors go to the Triton launcher. A new kernel is one
file under ``kernels/`` (twin, Triton kernel, launcher) ending in one :func:`register` call.

A launcher that fails to compile or launch (an older GPU, another Triton version) is logged once,
by name, and its twin runs instead, then and from then on: a kernel never ends a user's training.
A launch that fails asynchronously, after the call returned, leaves the CUDA context unusable;
nothing can catch that here. Set ``HF_ACTQ_DISABLE_TRITON=1`` to run the twins on GPU too
(debugging, bisecting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator

import torch

from hf_actq.kernels import triton_common

logger = logging.getLogger("hf_actq")

LIBRARY = torch.library.Library("hf_actq", "FRAGMENT")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Kernel:
    name: str
    twin: Callable
    launcher: Callable  # the Triton launcher: the twin's signature, the twin's outputs
    takes: Callable[..., bool]  # whether the launcher takes these arguments (their dtypes)


KERNELS: dict[str, Kernel] = {}
# Kernels that failed to compile or launch, with why: their twins run from then on.
FAILED: dict[str, str] = {}


def triton_available() -> bool:
    return triton_common.triton is not None


def triton_enabled() -> bool:
    return os.environ.get("HF_ACTQ_DISABLE_TRITON", "0") in ("", "0") and triton_available()


def register(name: str, twin, launcher, *, fake, takes) -> KernelOp:
    """``hf_actq::<name>``, its schema read from ``twin``'s annotations: ``twin`` by default,
    ``launcher`` (falling back to ``twin``) on CUDA tensors that ``takes`` accepts, ``fake``
    for torch.compile. Returns the op, to be called as the twin is."""
    LIBRARY.define(name + torch.library.infer_schema(twin, mutates_args=()))
    LIBRARY.impl(name, twin, "CompositeExplicitAutograd")
    kernel = KERNELS[name] = Kernel(name, twin, launcher, takes)
    LIBRARY.impl(name, functools.partial(kernel_or_twin, kernel), "CUDA")
    torch.library.register_fake(f"hf_actq::{name}", fake, lib=LIBRARY)
    return KernelOp(kernel, getattr(torch.ops.hf_actq, name).default)


# Devices whose tensors go to the launchers: CUDA, and the CPU while kernels_on_cpu is active.
_KERNEL_DEVICES = {"cuda"}
_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda tensor: False)


class KernelOp:
    """A registered kernel op, called as its twin is. In eager mode on a kernel device the
    launcher is called directly: the dispatcher's round trip into Python (about 5 µs a call on
    the host, several per compressed op) buys nothing there. A torch.compile trace, and every
    other device, take the registered op. Under the profiler the direct call is recorded under
    the op's name, as the dispatcher would record it."""

    def __init__(self, kernel: Kernel, op: torch._ops.OpOverload) -> None:
        self.kernel, self.op = kernel, op
        self._label = f"hf_actq::{kernel.name}"

    def __call__(self, first, *args, **kwargs):
        if kwargs:  # keywords: the op binds them to the schema
            return self.op(first, *args, **kwargs)
        if (
            type(first) is not torch.Tensor  # fake, functional or distributed tensors
            or first.device.type not in _KERNEL_DEVICES
            or torch.compiler.is_compiling()
            or _is_wrapped(first)  # functorch's transforms
        ):
            return self.op(first, *args)
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(self._label):
                return kernel_or_twin(self.kernel, first, *args)
        return kernel_or_twin(self.kernel, first, *args)

    def __repr__(self) -> str:
        return f"KernelOp({self._label})"


def seed_beside(source: torch.Tensor, device_seed: torch.Tensor | None = None) -> bool:
    """Whether a kernel can read ``device_seed`` (none, or on ``source``'s device): a kernel given
    a pointer to another device's memory would fault, where the twin reads it anywhere."""
    return device_seed is None or device_seed.device == source.device


def runs_kernels(tensor: torch.Tensor) -> bool:
    """Whether the kernel ops launch Triton kernels for ``tensor`` (not their twins)."""
    return tensor.device.type in _KERNEL_DEVICES and triton_enabled()


def kernel_or_twin(kernel: Kernel, *args):
    if kernel.name not in FAILED and triton_enabled() and kernel.takes(*args):
        try:
            return kernel.launcher(*args)
        except Exception as error:  # noqa: BLE001 (compiler, resources, driver: any of them)
            FAILED[kernel.name] = f"{type(error).__name__}: {str(error)[:300]}"
            logger.warning(
                "hf_actq: the Triton kernel of hf_actq::%s failed (%s); its PyTorch twin runs "
                "instead from now on (slower, same results). Set HF_ACTQ_DISABLE_TRITON=1 to "
                "skip the kernels.",
                kernel.name,
                FAILED[kernel.name],
            )
    return kernel.twin(*args)


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """While active, CPU tensors take the path CUDA tensors take. Under ``TRITON_INTERPRET=1``
    the Triton kernels run on CPU tensors: the GPU check's dry run and the forced-failure tests
    go through the dispatch a GPU does."""
    library = torch.library.Library("hf_actq", "IMPL")
    try:
        for kernel in KERNELS.values():
            library.impl(kernel.name, functools.partial(kernel_or_twin, kernel), "CPU")
        _KERNEL_DEVICES.add("cpu")
        yield
    finally:
        _KERNEL_DEVICES.discard("cpu")
        library._destroy()
