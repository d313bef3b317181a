"""recipes/common/records.py: what every recipe records of a run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

from common.records import recipe_label  # noqa: E402
from hf_actq import ActQConfig  # noqa: E402


def test_recipe_labels_name_the_bits_that_define_each_recipe():
    assert recipe_label(None) == "baseline"
    assert recipe_label(ActQConfig.from_recipe("fewbit", bits=3)) == "fewbit-3"
    assert recipe_label(ActQConfig.from_recipe("alam", adaptive=False)) == "alam-1-even"
    assert recipe_label(ActQConfig.from_recipe("alam", bits=2)) == "alam-2"
    kept = ActQConfig.from_recipe("alam", bits=2, allocate_activations=False)
    assert recipe_label(kept) == "alam-2-fewbit-act"
    # The checkpoint recipe keeps its other slots at 8 bits; its label names the layers' inputs.
    rotated = ActQConfig.from_recipe("checkpoint", bits=4)  # rotated inputs by default
    assert (rotated.checkpoint_bits, rotated.checkpoint_codec) == (4, "rotated")
    assert recipe_label(rotated) == "checkpoint-4-rotated"
    plain = ActQConfig.from_recipe("checkpoint", bits=4, checkpoint_codec="uniform")
    assert recipe_label(plain) == "checkpoint-4"
    uniform = ActQConfig.from_recipe("uniform", bits=4, codec="rotated")
    assert recipe_label(uniform) == "uniform-4-rotated"
