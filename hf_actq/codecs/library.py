"""The codecs as two PyTorch custom operators, ``hf_actq::pack`` and ``hf_actq::unpack``: the
form a ``torch.compile`` trace takes them in.

Eager code calls ``codec.pack`` directly. Under ``torch.compile`` the ops call
:func:`compiled_pack` and :meth:`Packed.unpack` instead, so each codec is one opaque node whose
output sizes are known from the shape alone (``Codec.buffers``), with no graph break for the
Python loops, generators and ``.item()`` calls inside. The compiled graph then keeps the packed
buffers for backward, where ``saved_tensors_hooks`` would keep nothing compressed under compile.
The codec travels as its ``op_key`` string and is rebuilt (cached) on the other side; a
stochastic codec's seed is drawn in the graph as a tensor.
"""

from __future__ import annotations

import functools
import json

import torch

from hf_actq.codecs.named import make_codec
from hf_actq.codecs.packed import Codec, Packed


@functools.cache
def codec_from_key(key: str) -> Codec:
    name, params = key.split(":", 1)
    return make_codec(name, **json.loads(params))


@torch.library.custom_op("hf_actq::pack", mutates_args=())
def pack_op(x: torch.Tensor, codec: str, seed: torch.Tensor | None) -> list[torch.Tensor]:
    packed = codec_from_key(codec).pack(x, None if seed is None else int(seed.item()))
    return list(packed.tensors)


@pack_op.register_fake
def _(x, codec, seed):
    on_cpu = codec_from_key(codec).cpu_buffers
    return [
        x.new_empty(numel, dtype=dtype, device="cpu" if i in on_cpu else x.device)
        for i, (numel, dtype) in enumerate(codec_from_key(codec).buffers(x.shape))
    ]


@torch.library.custom_op("hf_actq::unpack", mutates_args=())
def unpack_op(
    buffers: list[torch.Tensor], codec: str, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    header = Packed(codec_from_key(codec), torch.Size(shape), dtype, tuple(buffers))
    return header.codec.unpack(header)  # always a new tensor: no codec returns its buffers


@unpack_op.register_fake
def _(buffers, codec, shape, dtype):
    return buffers[0].new_empty(shape, dtype=dtype)


def compiled_pack(x: torch.Tensor, codec: Codec, seed: torch.Tensor | None) -> Packed:
    """``codec.pack(x)`` as one traced op; ``seed`` from :func:`draw_seed_tensor`."""
    return Packed(codec, x.shape, x.dtype, tuple(pack_op(x, codec.op_key, seed)))
