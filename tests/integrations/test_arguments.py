"""``parse_arguments``: ActQConfig on a recipe's command line next to TrainingArguments."""

import json
from dataclasses import dataclass, field

import pytest
from transformers import TrainingArguments

from hf_actq import ActQConfig
from hf_actq.integrations.arguments import parse_arguments


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="tiny")


def _parse(*args):
    parsed = parse_arguments(
        (ModelArguments, ActQConfig, TrainingArguments), ["--output_dir", "o", *args]
    )
    return parsed[1]


def test_a_named_recipe_with_explicit_fields_overriding_it():
    assert _parse("--recipe", "alam") == ActQConfig.from_recipe("alam")
    # bits=3 is ActQConfig's default, yet given explicitly it overrides alam's 1.
    config = _parse("--recipe", "alam", "--bits", "3", "--no_attention", "--adaptive", "false")
    assert config == ActQConfig.from_recipe("alam", bits=3, attention=False, adaptive=False)
    assert _parse("--recipe", "fewbit", "--bits", "2").activation_bits == 2
    assert _parse("--recipe", "fewbit", "--bits", "2").linear is False
    # alam's fractional bits with its own codec (AQ), not the default codec's integers.
    assert _parse("--recipe", "alam", "--bits", "0.5") == ActQConfig.from_recipe("alam", bits=0.5)
    # "checkpoint": --bits is the layers' inputs' precision; the rest stays at 8 bits.
    config = _parse("--recipe", "checkpoint", "--bits", "3")
    assert (config.checkpoint_bits, config.bits, config.compress_checkpointed) == (3, 8, False)


def test_without_a_recipe_fields_are_taken_as_given():
    config = _parse("--bits", "4", "--codec", "blpa", "--skip_modules", "classifier", "pooler")
    assert config == ActQConfig(bits=4, codec="blpa", skip_modules=["classifier", "pooler"])


def test_slots_as_json_on_the_command_line_and_a_json_file(tmp_path):
    slots = {
        "re::input$": {"bits": 4},
        "bert.encoder.layer.0.output.dense:input": {"codec": "exact"},
    }
    assert _parse("--slots", json.dumps(slots)).slots == slots
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"output_dir": "o", "recipe": "uniform", "bits": 2, "slots": slots}))
    parsed = parse_arguments((ModelArguments, ActQConfig, TrainingArguments), [str(path)])
    assert parsed[1] == ActQConfig.from_recipe("uniform", bits=2, slots=slots)
    assert parsed[0].model_name_or_path == "tiny" and parsed[2].output_dir == "o"


def test_bad_values_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="slots must be a dict or its JSON"):
        _parse("--slots", "{not json")
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        _parse("--bits", "9")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        _parse("--recipe", "fastest")
