"""The package's top level is the small public API (ARCHITECTURE.md §4); the rest is in its
subpackages."""

import hf_actq


def test_the_top_level_is_the_public_api_and_every_name_resolves():
    assert sorted(hf_actq.__all__) == [
        "ActQCallback", "ActQConfig", "ActQHandle", "BitPlan", "SavedTensorMeter", "apply",
        "measure_model", "revert",
    ]  # fmt: skip
    for name in hf_actq.__all__:
        assert getattr(hf_actq, name) is not None
    from hf_actq.ops import CompressedLinear, FewBitGELU

    assert CompressedLinear.__module__.startswith("hf_actq.ops")
    assert FewBitGELU.__module__.startswith("hf_actq.ops")
    assert not hasattr(hf_actq, "FewBitGELU")
