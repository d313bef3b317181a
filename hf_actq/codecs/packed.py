"""The compressed form of a saved tensor and the codec interface."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

import torch

# How many values share one min/scale (or step); the Triton kernels are compiled for these.
BLOCK_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Packed:
    """Compact buffers of one tensor plus what is needed to rebuild it.

    ``tensors`` holds only compact buffers (packed codes first, then per-block metadata); their
    sizes depend on ``shape`` and the codec's parameters, never on the data. An op saves them with
    ``ctx.save_for_backward(*packed.tensors)`` and rebuilds the object in backward with
    ``header.with_tensors(ctx.saved_tensors)``, where ``header = packed.with_tensors(())``.
    """

    codec: Codec
    shape: torch.Size
    dtype: torch.dtype
    tensors: tuple[torch.Tensor, ...]

    # The ops that keep these very buffers (an UnpackShare), when the pack cache (ops/dedup.py)
    # gave them to several: set per pack (not a field), and ``with_tensors`` carries it.
    _share = None

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer this object holds (codes and metadata)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def with_tensors(self, tensors) -> Packed:
        # A copy with other tensors: the fields as they are (validated when first made), without
        # dataclasses.replace's __init__ (about 6 µs, three times per compressed op a step).
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "tensors", tuple(tensors))
        return copy

    def unpack(self) -> torch.Tensor:
        """The tensor rebuilt: once a backward for a pack several ops keep (the first to ask
        unpacks, the others take its result), else each time."""
        share = self._share
        if share is not None and share.consumers > 1 and not torch.compiler.is_compiling():
            return share.take(self)
        return self._unpack()

    def _unpack(self) -> torch.Tensor:
        if torch.compiler.is_compiling() and self.codec.name != "exact":
            # One opaque node in the trace: the operator codecs/library.py registers (the
            # package imports it), called through torch's registry so that this module, which
            # every codec imports, imports none of them.
            return torch.ops.hf_actq.unpack(
                list(self.tensors), self.codec.op_key, list(self.shape), self.dtype
            )
        layout = self.codec.layout(self.shape) if len(self.tensors) == 1 else None
        if layout is not None:
            # The pack op's one allocation (a traced pack), unpacked by the unpack op or outside
            # a trace: a compiled forward's pack that an eager backward reads.
            from hf_actq.kernels.packing import views_of

            return self.codec.unpack(self.with_tensors(views_of(self.tensors[0], layout)))
        return self.codec.unpack(self)


class UnpackShare:
    """The consumers of one pack (q, k and v of one norm's output; the LoRA adapters of one
    input) and, while some of them have not run their backward, the tensor the first one
    unpacked. It lives as long as the consumers' saved headers (the autograd graph), so a
    consumer whose backward never asks keeps the value no longer than the graph lives."""

    __slots__ = ("consumers", "left", "value")

    def __init__(self, consumers: int = 0) -> None:
        self.consumers, self.left, self.value = consumers, 0, None

    def take(self, packed: Packed) -> torch.Tensor:
        if self.value is None:
            self.value, self.left = packed._unpack(), self.consumers
        value = self.value
        self.left -= 1
        if self.left <= 0:  # the last consumer: the graph holds it no longer
            self.value = None
        return value

    def leave(self) -> None:
        """A consumer that rebuilds what it needs without the unpacked tensor (a fused kernel
        reading the packed buffers): the others no longer keep the tensor for it."""
        if self.value is None:
            self.consumers -= 1
            return
        self.left -= 1
        if self.left <= 0:
            self.value = None


class Codec:
    """Base of every codec: a frozen, validated dataclass with ``pack`` and ``unpack``."""

    name = "codec"
    # Buffers kept on the CPU whatever the input's device (a seed that backward reads).
    cpu_buffers: tuple[int, ...] = ()
    # Whether ``pack`` takes its seed as a one-element int64 tensor on the input's device (the
    # kernels read it there, so a CUDA graph replays it fresh) as well as a host int.
    takes_device_seed = False

    @property
    def uses_rng(self) -> bool:
        """Whether ``pack`` takes a seed drawn from torch's RNG (``draw_seed``): codecs that
        round stochastically."""
        return getattr(self, "stochastic", False)

    def __post_init__(self):
        # The codec as a string, the form the custom operators torch.compile traces take
        # (codecs/library.py); computed once here, where no trace is running.
        params = {f.name: getattr(self, f.name) for f in fields(self)}
        object.__setattr__(self, "op_key", f"{self.name}:{json.dumps(params, sort_keys=True)}")

    def layout(self, shape):
        """Where the pack's tensors lie in the one allocation ``pack`` makes for ``shape``
        (``kernels.packing.Layout``), or None where they are tensors of their own. The traced
        pack op returns that allocation: a custom op's outputs may not alias each other."""
        return None

    def pack(self, x: torch.Tensor, seed: int | None = None) -> Packed:
        raise NotImplementedError

    def unpack(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def buffers(self, shape) -> tuple[tuple[int, torch.dtype], ...]:
        """``(numel, dtype)`` of each 1-D buffer :meth:`pack` keeps for a tensor of ``shape``,
        in order: sizes depend on the shape alone."""
        raise NotImplementedError

    def nbytes(self, shape) -> int:
        """Exact bytes :meth:`pack` keeps for a tensor of ``shape`` (known before packing)."""
        return sum(numel * dtype.itemsize for numel, dtype in self.buffers(shape))

    def bits_per_element(self, shape: tuple[int, ...]) -> float:
        """Effective bits per element, metadata included."""
        numel = torch.Size(shape).numel()
        return 8 * self.nbytes(shape) / max(numel, 1)


def numel_of(shape) -> int:
    """Elements of ``shape`` (symbolic sizes stay symbolic, as a torch.compile trace needs)."""
    return math.prod(shape)


def check_floating(x: torch.Tensor, codec: Codec) -> None:
    if not x.dtype.is_floating_point:
        raise ValueError(
            f"{codec.name} codec packs floating-point tensors (float32, float16, bfloat16), "
            f"got {x.dtype}"
        )


def validate_int(name: str, value, allowed) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        if list(allowed) == list(range(min(allowed), max(allowed) + 1)):
            shown = f"an integer in {min(allowed)}..{max(allowed)}"
        else:
            shown = "one of " + ", ".join(map(str, allowed))
        raise ValueError(f"{name} must be {shown}, got {value!r}")
    return value


# Seeds live in [0, 2**31 - 1): the range every generator's ``manual_seed`` and the Triton
# kernels' 32-bit Philox offsets take.
_SEED_MODULUS = 2**31 - 1
# Added once per rank (mod the prime above), so ranks never share a seed; rank 0 keeps the
# drawn seed, so single-process runs draw exactly what torch's RNG gives.
_RANK_STRIDE = 0x9E3779B1


def capturing_cuda_graph(device: torch.device | None) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph in eager mode
    (``torch.cuda.graph``, ``make_graphed_callables``). A seed drawn on the host is then frozen
    into the graph: every replay rounds with the noise of the capture."""
    return device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def draw_seed() -> int:
    """A seed from torch's CPU generator, salted with the process rank.

    From torch's generator: ``torch.manual_seed`` and checkpointing's RNG replay (which restores
    the CPU state too) reproduce it, and drawing exactly one per pack keeps the RNG stream
    independent of whether a shared input was found already packed. Salted with the rank:
    data-parallel launchers seed every rank identically, and ranks that draw the same rounding
    noise would not average it away when their gradients are reduced.
    """
    return int(draw_seed_tensor().item())


def draw_seed_tensor(device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`draw_seed`'s seed as a one-element int64 tensor: the form a torch.compile trace
    draws, where reading the value (``.item()``) would break the graph. On another ``device``
    it comes from that device's generator (which a CUDA graph advances on each replay)."""
    seed = torch.randint(0, _SEED_MODULUS, (1,), device=device)
    rank = process_rank()
    return seed if rank == 0 else (seed + rank * _RANK_STRIDE) % _SEED_MODULUS


def seed_arguments(seed: int | torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """A codec's seed as the kernel ops take it: a host int, or 0 and a device tensor."""
    if isinstance(seed, torch.Tensor):
        return 0, seed
    return seed or 0, None


def skip_seeds(*codecs) -> None:
    """Draw and discard the seeds that packing with ``codecs`` would draw (None: exact slot).

    A training-mode forward that keeps nothing for backward (under ``no_grad``, as reentrant
    checkpointing runs its first pass) must consume the RNG exactly as the pass that keeps
    everything, or every dropout after it would draw a different mask in the recompute.
    """
    for codec in codecs:
        if codec is not None and codec.uses_rng:
            torch.randint(0, _SEED_MODULUS, (1,), device="cpu")


def process_rank() -> int:
    """The global rank: torch.distributed's when initialized, else the launcher's ``RANK``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK") or 0)


@dataclass(frozen=True)
class ExactCodec(Codec):
    """Keeps the tensor itself (compacted: a view of a larger tensor would otherwise keep that
    whole storage alive). For slots a recipe leaves uncompressed inside a fused op."""

    name = "exact"

    def nbytes(self, shape) -> int:
        raise ValueError("the exact codec's size depends on the dtype; use Packed.nbytes")

    def pack(self, x: torch.Tensor, seed: int | None = None) -> Packed:
        return Packed(self, x.shape, x.dtype, (x.contiguous(),))

    def unpack(self, packed: Packed) -> torch.Tensor:
        return packed.tensors[0]
