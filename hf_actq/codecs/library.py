"""The codecs as two PyTorch custom operators, ``hf_actq::pack`` and ``hf_actq::unpack``: the
form a ``torch.compile`` trace takes them in.

Eager code calls ``codec.pack`` directly. Under ``torch.compile`` the ops call
:func:`compiled_pack` and :meth:`Packed.unpack` instead, so each codec is one opaque node whose
output sizes are known from the shape alone (``Codec.buffers``), with no graph break for the
Python loops, generators and ``.item()`` calls inside. The compiled graph then keeps the packed
buffers for backward, where ``saved_tensors_hooks`` would keep nothing compressed under compile.
The codec travels as its ``op_key`` string and is rebuilt (cached) on the other side; a
stochastic codec's seed is drawn in the graph as a tensor, which the kernels of codecs that
take it there (``Codec.takes_device_seed``) read on the device: no host read in the step, and a
CUDA graph of it rounds with fresh seeds on each replay.
"""

from __future__ import annotations

import functools
import json

import torch

from hf_actq.codecs.named import make_codec
from hf_actq.codecs.packed import Codec, Packed
from hf_actq.kernels.packing import allocation_bytes


@functools.cache
def codec_from_key(key: str) -> Codec:
    name, params = key.split(":", 1)
    return make_codec(name, **json.loads(params))


@torch.library.custom_op("hf_actq::pack", mutates_args=())
def pack_op(x: torch.Tensor, codec: str, seed: torch.Tensor | None) -> list[torch.Tensor]:
    """The pack's tensors, or the one allocation they are views of (``Codec.layout``): a custom
    op's outputs may not alias each other."""
    instance = codec_from_key(codec)
    if seed is not None and not instance.takes_device_seed:
        seed = int(seed.item())
    tensors = instance.pack(x, seed).tensors
    layout = instance.layout(x.shape)
    if layout is not None:
        return [_allocation_of(tensors, allocation_bytes(layout))]
    # Tensors of their own; a part of a larger allocation (the rotated codec's codes and their
    # metadata, from the average codec's) is copied out.
    return [tensor if _whole(tensor) else tensor.clone() for tensor in tensors]


def _whole(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.itemsize


def _allocation_of(tensors, nbytes: int) -> torch.Tensor:
    """The allocation ``tensors`` are views of, as one uint8 tensor of ``nbytes``."""
    storage = tensors[0].untyped_storage()
    if storage.nbytes() != nbytes or any(
        tensor.untyped_storage().data_ptr() != storage.data_ptr() for tensor in tensors
    ):
        raise AssertionError("a codec with a layout made tensors that are not views of one")
    return tensors[0].view(torch.uint8).as_strided((nbytes,), (1,), 0)


@pack_op.register_fake
def _(x, codec, seed):
    instance = codec_from_key(codec)
    layout = instance.layout(x.shape)
    if layout is not None:
        return [x.new_empty(allocation_bytes(layout), dtype=torch.uint8)]
    return [
        x.new_empty(numel, dtype=dtype, device="cpu" if i in instance.cpu_buffers else x.device)
        for i, (numel, dtype) in enumerate(instance.buffers(x.shape))
    ]


@torch.library.custom_op("hf_actq::unpack", mutates_args=())
def unpack_op(
    buffers: list[torch.Tensor], codec: str, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    header = Packed(codec_from_key(codec), torch.Size(shape), dtype, tuple(buffers))
    # Run eagerly (the op is opaque to the trace); takes pack_op's one allocation apart. Always
    # a new tensor: no codec returns its buffers.
    return header._unpack()


@unpack_op.register_fake
def _(buffers, codec, shape, dtype):
    return buffers[0].new_empty(shape, dtype=dtype)


def compiled_pack(x: torch.Tensor, codec: Codec, seed: torch.Tensor | None) -> Packed:
    """``codec.pack(x)`` as one traced op; ``seed`` from :func:`draw_seed_tensor`."""
    # A codec with a layout keeps its one allocation, which unpack_op takes apart: views of it
    # made here would escape the autograd Function that traces them (dynamo refuses that).
    return Packed(codec, x.shape, x.dtype, tuple(pack_op(x, codec.op_key, seed)))
