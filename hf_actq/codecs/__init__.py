"""Codecs for saved tensors: ``pack(x, codec) -> Packed`` and ``unpack(packed) -> Tensor``.

``Packed`` holds only compact buffers (codes and per-block metadata) plus shape and dtype; its
size depends only on the shape (``codec.nbytes(shape)`` tells it before packing).
"""

from __future__ import annotations

import torch

from hf_actq.codecs import library  # noqa: F401  (registers hf_actq::pack and ::unpack)
from hf_actq.codecs.average import AverageQuantCodec, uniform
from hf_actq.codecs.mask import MaskCodec
from hf_actq.codecs.named import CODECS, make_codec
from hf_actq.codecs.packed import Codec, Packed
from hf_actq.codecs.rotated import RotatedSampleCodec
from hf_actq.codecs.sign_preserving import SignPreservingCodec
from hf_actq.codecs.smaq import SmaQCodec


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
