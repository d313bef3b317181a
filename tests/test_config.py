"""``ActQConfig``: a named recipe means the same wherever a config is built, and every bad value
is a one-line ValueError that names it."""

import math

import pytest

import hf_actq
from hf_actq import ActQCallback, ActQConfig
from hf_actq.report import cli
from hf_actq.testing import tiny_llama


@pytest.mark.parametrize("recipe", ["fewbit", "uniform", "alam", "checkpoint"])
def test_a_named_recipe_is_that_recipe_wherever_the_config_is_built(recipe):
    expected = ActQConfig.from_recipe(recipe)
    assert ActQConfig(recipe=recipe) == expected
    assert ActQCallback(recipe=recipe).config == expected
    assert ActQConfig.from_dict({"recipe": recipe}) == expected
    assert ActQConfig.from_dict(expected.to_dict()) == expected
    assert expected.replace() == expected


def test_fields_given_with_a_recipe_override_it():
    config = ActQConfig(recipe="fewbit", linear=True, bits=2)
    assert (config.linear, config.norm, config.activation_bits) == (True, False, 2)
    assert ActQConfig(recipe="alam", bits=2) == ActQConfig.from_recipe("alam", bits=2)
    assert ActQConfig(recipe="alam", codec="uniform", bits=4).codec == "uniform"
    # "checkpoint": bits are the checkpointed layers' (the rest is kept at 8 bits) unless
    # checkpoint_bits is given too.
    layers_at_3 = ActQConfig(recipe="checkpoint", bits=3)
    assert (layers_at_3.bits, layers_at_3.checkpoint_bits) == (8, 3)
    both = ActQConfig(recipe="checkpoint", bits=6, checkpoint_bits=2)
    assert (both.bits, both.checkpoint_bits) == (6, 2)
    # Without a recipe, fields are taken as given.
    assert ActQConfig(bits=3).linear and ActQConfig(bits=3).fused_loss


def test_fewbit_keeps_every_output_of_the_stock_model():
    config = ActQConfig.from_recipe("fewbit")
    assert not (config.linear or config.norm or config.attention or config.fused_loss)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ActQConfig.from_recipe("fewbit", nosuch=1), "unknown ActQConfig field 'nosuch'"),
        (lambda: ActQConfig(bitz=3), r"unknown ActQConfig field 'bitz' \(did you mean 'bits'\?\)"),
        (lambda: ActQConfig.from_dict({"bitz": 3}), "unknown ActQConfig field 'bitz'"),
        (lambda: ActQConfig(recipe="fast"), "unknown recipe 'fast'; choose from fewbit"),
        (lambda: ActQConfig(fused_loss="no"), "fused_loss must be True or False, got 'no'"),
        (lambda: ActQConfig(share_norm_outputs=0), "share_norm_outputs must be True or False"),
        (lambda: ActQConfig(compress_checkpointed=1), "compress_checkpointed must be True"),
        (lambda: ActQConfig(calibration_seconds=math.nan), "calibration_seconds must be a positive"),
        (lambda: ActQConfig(calibration_seconds=-5), "calibration_seconds must be a positive"),
        (lambda: ActQConfig(calibration_examples=0), "calibration_examples must be a positive"),
        (lambda: ActQConfig(recalibrate_at=math.nan), r"recalibrate_at must be in \[0, 1\)"),
        (lambda: ActQConfig(group_size=True), "group_size must be one of"),
        (lambda: ActQConfig(skip_modules=[3]), "skip_modules must be a list of regexes"),
        (lambda: ActQConfig(slots={"a:b": {"bits": 4, "size": 2}}), r"slots\['a:b'\]: a setting must be a dict with keys among"),
        (lambda: ActQConfig(slots={"a:b": {"codec": "zip"}}), r"slots\['a:b'\]: codec must be one of exact"),
        (lambda: ActQConfig(slots={"m:act": {"bits": 7}}), r"slots\['m:act'\]: a few-bit slot's bits must be an integer in 1..4, got 7"),
        (lambda: ActQConfig(slots={"m:act": {"size": 2}}), r"slots\['m:act'\]: a few-bit slot's setting is"),
        (lambda: ActQConfig(slots={"m:act": {"codec": "zip"}}), r"slots\['m:act'\]: codec must be one of"),
        (lambda: ActQCallback(bits=4, nosuch=2), "unknown ActQConfig field 'nosuch'"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_errors_that_name_them(make, match):
    with pytest.raises(ValueError, match=match) as raised:
        make()
    assert "\n" not in str(raised.value)


def test_a_plan_setting_is_checked_with_its_slot_named():
    model = tiny_llama()
    handle = hf_actq.apply(model, bits=4)
    act = next(slot for slot in handle.slots if slot.endswith(":act"))
    codec_slot = next(slot for slot in handle.slots if not slot.endswith(":act"))
    for slot, setting, match in (
        (act, {"bits": 7}, "a few-bit slot's bits must be an integer in 1..4, got 7"),
        (codec_slot, {"codec": "uniform", "bits": 4, "extra": 1}, "keys among"),
        (codec_slot, {"codec": "uniform", "bits": 9}, "bits must be"),
    ):
        plan = hf_actq.BitPlan({s: {"bits": 4} for s in handle.slots})
        plan.slots[slot] = setting
        with pytest.raises(ValueError, match=rf"bit plan: slot '{slot}': .*{match}"):
            handle.set_plan(plan)
    handle.revert()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--calibration-examples", "0"], "--calibration-examples: expected a positive integer"),
        (["--calibration-seconds", "-5"], "--calibration-seconds: expected a positive number"),
        (["--calibration-slots", "0"], "--calibration-slots: expected a positive integer"),
        (["--batch-size", "0"], "--batch-size: expected a positive integer"),
        (["--recipe", "uniform:nosuch=3"], "hf-actq memory: unknown ActQConfig field 'nosuch'"),
        (["--recipe", "uniform:bits"], "must look like key=value"),
    ],
)
def test_the_memory_command_names_what_was_wrong(argv, match, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["tiny-llama", "--no-progress", *argv])
    message = (
        str(raised.value.code) if isinstance(raised.value.code, str) else capsys.readouterr().err
    )
    assert raised.value.code != 0
    assert match in message
    assert "Traceback" not in message
