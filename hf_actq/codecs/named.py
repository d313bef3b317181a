"""Every codec by name: the one table a name and its parameters become a codec through."""

from __future__ import annotations

from hf_actq.codecs.average import AverageQuantCodec, uniform
from hf_actq.codecs.mask import MaskCodec
from hf_actq.codecs.packed import Codec
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
