"""ALAM's sensitivity and allocation (hf_actq/adaptive/alam.py) on cases worked by hand."""

import math

import pytest
import torch

from hf_actq import ActQConfig
from hf_actq.adaptive import alam
from hf_actq.codecs.packed import ExactCodec


def test_sensitivity_takes_the_seed_change_or_twice_the_change_against_8_bits():
    # d01 = 0.25 (seeds), d02 = 0.25, d12 = 0.5 (against 8 bits): max(0.25, 2 * 0.5) = 1.
    assert alam.sensitivity([1.0, 2.0], [1.0, 2.5], [1.5, 2.0]) == 1.0
    # A bias no seed changes (g0 == g1) still shows against 8 bits.
    assert alam.sensitivity(torch.tensor([3.0]), torch.tensor([3.0]), torch.tensor([1.0])) == 8.0
    assert alam.sensitivity([math.nan], [1.0], [1.0]) == alam.CAP
    assert alam.sensitivity([1e6], [-1e6], [0.0]) == alam.CAP
    with pytest.raises(ValueError, match="one entry per parameter"):
        alam.sensitivity([1.0], [1.0, 2.0], [1.0])


def test_allocation_steps_down_the_least_sensitive_tensor_first():
    # 2 x 10 elements start exact (640 bits); a budget of 20 bits each (400) needs one step:
    # the less sensitive tensor goes to 8 bits.
    precisions, bits = alam.allocate({"a": 1.0, "b": 100.0}, {"a": 10, "b": 10}, 20)
    assert precisions == {"a": 8, "b": "exact"} and bits == 400


def test_allocation_ranks_the_step_to_aq_as_one_bit_as_the_official_code_does():
    # Per element (n = 1), the steps' added variance per ranked bit: a (C = 1): 6.4e-7, 1.1e-3,
    # 5.3e-2, then 2 -> AQ 0.889 (0.593 per true bit); b (C = 12): 7.7e-6, 1.3e-2, then
    # 4 -> 2 0.64. After a -> 2 and b -> 4 (6 bits kept), a budget of 4.5 bits needs one more
    # step: ranked as one bit, a's AQ step (0.889) loses to b's 0.64, so b goes to 2 bits; by
    # its true 1.5 bits (0.593) it would have won.
    precisions, bits = alam.allocate({"a": 1.0, "b": 12.0}, {"a": 1, "b": 1}, 2.25)
    assert precisions == {"a": 2, "b": 2} and bits == 4.0


def test_allocation_meets_any_budget_down_to_aq_and_no_further():
    sensitivities = {f"t{i}": float(10**i) for i in range(5)}
    elements = {f"t{i}": 100 * (i + 1) for i in range(5)}
    total = sum(elements.values())
    for target in (32, 8, 3.3, 1, 0.6, 0.5):
        precisions, bits = alam.allocate(sensitivities, elements, target)
        assert bits <= target * total + 1e-9
        assert bits == sum(alam.BITS[precisions[t]] * n for t, n in elements.items())
    precisions, bits = alam.allocate(sensitivities, elements, 0.1)
    assert set(precisions.values()) == {"aq"} and bits == 0.5 * total
    assert alam.allocate(sensitivities, elements, 32)[0] == dict.fromkeys(elements, "exact")
    with pytest.raises(ValueError, match="same tensors"):
        alam.allocate({"a": 1.0}, {"b": 1}, 2)
    with pytest.raises(ValueError, match="target_bits must be a positive number"):
        alam.allocate({"a": 1.0}, {"a": 1}, 0)


def test_ties_go_to_the_tensor_listed_last():
    precisions, _ = alam.allocate({"a": 1.0, "b": 1.0}, {"a": 1, "b": 1}, 20)
    assert precisions == {"a": "exact", "b": 8}


def test_every_precision_is_a_setting_our_codecs_build():
    config = ActQConfig(bits=4)
    for precision in alam.LADDER:
        setting = alam.SETTINGS[precision]
        config.check_setting(setting)
        codec = config.codec_for_setting(setting)
        if precision == "exact":
            assert codec == ExactCodec()
        else:
            shape = (4, 128)
            code_bits = 8 * codec.buffers(shape)[0][0]
            assert code_bits == alam.BITS[precision] * 4 * 128


def _bert_and_batch():
    from hf_actq.testing import tiny_bert

    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": torch.tensor([0, 1, 0, 1])}


def test_the_recipe_measures_each_tensor_three_times_in_alams_context_on_one_example():
    import hf_actq
    from hf_actq.codecs import AverageQuantCodec

    model, batch = _bert_and_batch()
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam", bits=2))
    config = handle.config
    assert (config.adaptive, config.calibration_examples) == (True, 1)
    watched = "bert.encoder.layer.1.output.dense:input"
    state, name = handle._states[watched]
    seen = []

    def loss_fn(m, b):
        assert b["input_ids"].shape[0] == 1  # ALAM measures on one example
        seen.append(state.codecs[name])
        return m(**b).loss

    plan = handle.calibrate(batch, loss_fn=loss_fn)
    items = plan.info["measured"]
    assert len(seen) == 1 + 3 * items  # the first pass, then AQ twice and 8 bits per tensor
    uniform4 = config.codec_for_setting(alam.SETTINGS[4])
    aq = config.codec_for_setting(alam.SETTINGS["aq"])
    eight = config.codec_for_setting(alam.SETTINGS[8])
    assert seen.count(aq) == 2 and seen.count(eight) == 1  # when the watched tensor is measured
    assert seen[1:].count(uniform4) == 3 * (items - 1)  # every other pass: uniform 4 bits
    assert aq == AverageQuantCodec(2, 4)
    handle.set_plan(plan)
    assert state.codecs[name] == config.codec_for_setting(plan.slots[watched])
    handle.revert()


@pytest.mark.parametrize("bits", [pytest.param(2, marks=pytest.mark.slow), 1])
def test_the_plan_meets_alams_budget_in_code_bits_and_gelu_keeps_its_input(bits):
    import hf_actq
    from hf_actq.adaptive.calibrate import list_slots

    model, batch = _bert_and_batch()
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam", bits=bits))
    plan = handle.calibrate(batch)
    info = plan.info
    assert info["bytes"] <= info["budget_bytes"] and info["alam_bits"] <= bits
    assert info["alam_bits"] > bits - 0.5  # the budget is used, not wasted
    ladder = [alam.SETTINGS[p] for p in alam.LADDER]
    assert all(setting in ladder for setting in plan.slots.values())
    acts = [slot for slot in plan.slots if slot.endswith(":act")]
    assert acts and all("codec" in plan.slots[slot] for slot in acts)
    handle.set_plan(plan)
    # The code bytes a real forward keeps under the plan are ALAM's count of it.
    infos = list_slots(handle, {k: v[:1] for k, v in batch.items()})
    code_bits = 0
    for slot, slot_info in infos.items():
        if slot_info.shared_with is not None:
            continue
        codec = handle.config.codec_for_setting(plan.slots[slot])
        if codec == ExactCodec():  # exact: ALAM counts 32 bits
            code_bits += 32 * slot_info.numel
        else:
            code_bits += 8 * codec.buffers(slot_info.shape)[0][0]
    assert code_bits // 8 == info["bytes"]  # determinism: tests/adaptive/test_calibrate.py
    handle.revert()
