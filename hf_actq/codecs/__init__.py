"""Codecs for saved tensors: ``pack(x, codec) -> Packed`` and ``unpack(packed) -> Tensor``.

``Packed`` holds only compact buffers (codes and per-block metadata) plus shape and dtype; its
size depends only on the shape (``codec.nbytes(shape)`` tells it before packing).
"""

from __future__ import annotations

import torch

from hf_actq.codecs.average import AverageQuantCodec, uniform
from hf_actq.codecs.mask import MaskCodec
from hf_actq.codecs.packed import Codec, Packed
from hf_actq.codecs.rotated import RotatedSampleCodec
from hf_actq.codecs.sign_preserving import SignPreservingCodec
from hf_actq.codecs.smaq import SmaQCodec

CODECS = {
    "aq": AverageQuantCodec,
    "uniform": uniform,
    "blpa": SignPreservingCodec,
    "mask": MaskCodec,
    "smaq": SmaQCodec,
    "rotated": RotatedSampleCodec,
}


def make_codec(name: str, **params) -> Codec:
    """A codec by name ("aq", "uniform", "blpa", "mask", "smaq", "rotated") with its parameters."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; allowed values: {', '.join(sorted(CODECS))}")
    return CODECS[name](**params)


def pack(x: torch.Tensor, codec: Codec | str = "uniform", **params) -> Packed:
    """Compress ``x`` with ``codec`` (an object, or a name plus its parameters)."""
    if isinstance(codec, str):
        codec = make_codec(codec, **params)
    elif params:
        raise ValueError("pass parameters either in the codec object or with its name, not both")
    return codec.pack(x)


def unpack(packed: Packed) -> torch.Tensor:
    """Rebuild the (approximate) tensor from :func:`pack`'s output."""
    return packed.unpack()


__all__ = [
    "CODECS",
    "AverageQuantCodec",
    "Codec",
    "MaskCodec",
    "Packed",
    "RotatedSampleCodec",
    "SignPreservingCodec",
    "SmaQCodec",
    "make_codec",
    "pack",
    "unpack",
    "uniform",
]
