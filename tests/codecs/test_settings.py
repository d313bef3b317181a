"""hf_actq/codecs/settings.py: the one place a per-slot setting becomes a codec."""

import pytest

from hf_actq.codecs import AverageQuantCodec, RotatedSampleCodec, SignPreservingCodec
from hf_actq.codecs.packed import ExactCodec
from hf_actq.codecs.settings import codec_for_setting

DEFAULT = {"codec": "uniform", "bits": 4, "group_size": None, "block_size": 128}


def test_a_setting_takes_what_it_leaves_out_from_the_default():
    assert codec_for_setting({}, DEFAULT) == AverageQuantCodec(bits=4, group_size=1)
    assert codec_for_setting({"bits": 2, "block_size": 64}, DEFAULT) == AverageQuantCodec(
        bits=2, group_size=1, block_size=64
    )
    assert codec_for_setting({"codec": "exact"}, DEFAULT) == ExactCodec()
    assert codec_for_setting({"codec": "blpa"}, DEFAULT) == SignPreservingCodec(bits=4)


def test_naming_a_codec_lets_the_bits_choose_the_group():
    grouped = {**DEFAULT, "codec": "aq", "bits": 1, "group_size": 8}
    # The default's own group stands while the setting names no codec ...
    assert codec_for_setting({"bits": 0.5}, grouped) == AverageQuantCodec(bits=4, group_size=8)
    # ... and a setting that names one gets the group its bits call for (ALAM's 2-bit means).
    assert codec_for_setting({"codec": "aq", "bits": 0.5}, grouped) == AverageQuantCodec(
        bits=2, group_size=4
    )
    # Per slot, "rotated" below 2 bits samples the coefficients; from 2 bits it keeps them all.
    assert codec_for_setting({"codec": "rotated", "bits": 0.5}, DEFAULT) == RotatedSampleCodec(
        bits=2, group_size=4
    )
    assert codec_for_setting({"codec": "rotated"}, DEFAULT) == RotatedSampleCodec(4, 1)


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"codec": "zstd"}, "codec must be one of exact, uniform, aq, blpa, smaq, rotated"),
        ({"bitz": 2}, "a setting must be a dict with keys among codec, bits"),
        ({"bits": 9}, "bits must be an integer in 1..8 for codec 'uniform', got 9"),
        ({"codec": "aq", "bits": 0.01}, r"bits must be a number in 1/16..8 for codec 'aq'"),
        ({"group_size": 3}, "group_size must be one of 1, 2, 4, 8, 16 or None, got 3"),
        ({"block_size": 100}, "block_size must be one of 32, 64, 128, 256, got 100"),
        ({"codec": "rotated", "bits": 2.5}, "a 'rotated' setting's bits must be a number"),
        ("uniform", "a setting must be a dict"),
    ],
)
def test_a_setting_no_codec_can_be_made_of_says_what_was_wrong(setting, match):
    with pytest.raises(ValueError, match=match):
        codec_for_setting(setting, DEFAULT)
