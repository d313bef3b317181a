"""Per-slot settings and the one place a setting becomes a codec.

A setting is a dict with keys among ``SETTING_KEYS``: ``{"codec": "aq", "bits": 0.5}``,
``{"codec": "uniform", "bits": 4, "block_size": 64}``, ``{"codec": "exact"}`` (the slot kept as
it is). What a setting leaves out comes from a default setting (a config's own codec, bits,
group size and block size); naming a codec without a group size lets the bits choose it.
"""

from __future__ import annotations

import math

from hf_actq.codecs.average import AverageQuantCodec
from hf_actq.codecs.packed import BLOCK_SIZES, Codec, ExactCodec
from hf_actq.codecs.rotated import RotatedSampleCodec
from hf_actq.codecs.sign_preserving import SignPreservingCodec
from hf_actq.codecs.smaq import SmaQCodec

# The codecs a setting (and a config) may name, besides "exact". "rotated" is Hadamard-rotated
# stochastic rounding; in a per-slot setting below 2 bits it samples the coefficients, unbiased
# sub-1-bit storage that suits linear-layer inputs alone.
SETTING_CODECS = ("uniform", "aq", "blpa", "smaq", "rotated")
SETTING_KEYS = ("codec", "bits", "group_size", "block_size")
GROUP_SIZES = (1, 2, 4, 8, 16)


def group_for(bits: float) -> int:
    """Elements per stored value for an average of ``bits``: 2-bit codes over enough elements to
    reach it (ALAM's choice), none below 2 bits."""
    return 1 if bits >= 2 else min(16, 2 ** round(math.log2(2 / bits)))


def check_fields(codec, bits, group_size, block_size) -> None:
    """ValueError, saying what was wrong, unless the four make a codec (a config's own fields:
    a "rotated" config keeps every coefficient, so its bits are an integer from 2)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise ValueError(f"bits must be a number, got {bits!r}")
    if codec not in SETTING_CODECS:
        raise ValueError(f"codec must be one of {', '.join(SETTING_CODECS)}, got {codec!r}")
    low = {"aq": 0.0625, "rotated": 2}.get(codec, 1)
    if not low <= bits <= 8 or (codec != "aq" and bits != int(bits)):
        allowed = "a number in 1/16..8" if codec == "aq" else f"an integer in {low}..8"
        raise ValueError(f"bits must be {allowed} for codec {codec!r}, got {bits!r}")
    if group_size is not None and (isinstance(group_size, bool) or group_size not in GROUP_SIZES):
        raise ValueError(f"group_size must be one of 1, 2, 4, 8, 16 or None, got {group_size!r}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}"
        )


def codec_for_setting(setting: dict, default: dict) -> Codec:
    """The codec ``setting`` gives a slot, its missing keys taken from ``default`` (a full
    setting); ``ExactCodec`` for ``"codec": "exact"``. ValueError for a setting no codec can be
    made of."""
    unknown = set(setting) - set(SETTING_KEYS) if isinstance(setting, dict) else None
    if unknown is None or unknown:
        raise ValueError(
            f"a setting must be a dict with keys among {', '.join(SETTING_KEYS)}, got {setting!r}"
        )
    if setting.get("codec") not in (None, "exact", *SETTING_CODECS):
        raise ValueError(
            f"codec must be one of exact, {', '.join(SETTING_CODECS)}, got {setting['codec']!r}"
        )
    full = {**default, **setting}
    if "codec" in setting and "group_size" not in setting:
        full["group_size"] = None
    name, bits, group, block = (full[key] for key in SETTING_KEYS)
    if name == "exact":
        return ExactCodec()
    if name == "rotated" and "codec" in setting:
        return _rotated(bits, group, block)
    check_fields(name, bits, group, block)
    if name == "blpa":
        return SignPreservingCodec(bits=int(bits), block_size=block)
    if name == "smaq":
        return SmaQCodec()
    if name == "rotated":
        return RotatedSampleCodec(bits=int(bits), group_size=1, block_size=block)
    if name == "aq":
        group = group or group_for(bits)
        return AverageQuantCodec(
            bits=max(1, min(8, round(bits * group))), group_size=group, block_size=block
        )
    return AverageQuantCodec(bits=int(bits), group_size=group or 1, block_size=block)


def _rotated(bits, group, block) -> RotatedSampleCodec:
    """A per-slot "rotated" setting: every coefficient kept from 2 bits up (rotated uniform
    rounding), a sample of them below."""
    if (
        isinstance(bits, bool)
        or not isinstance(bits, (int, float))
        or not 1 / 16 <= bits <= 8
        or (bits >= 2 and bits != int(bits))
    ):
        raise ValueError(
            f"a 'rotated' setting's bits must be a number in 1/16..2 (sampled coefficients) "
            f"or an integer in 2..8 (every coefficient kept), got {bits!r}"
        )
    group = group or (1 if bits >= 2 else max(2, group_for(bits)))
    return RotatedSampleCodec(
        bits=max(1, min(8, round(bits * group))), group_size=group, block_size=block
    )
