"""ALAM's sensitivity and allocation (hf_actq/adaptive/alam.py) on cases worked by hand."""

import math

import pytest
import torch

from hf_actq import ActQConfig
from hf_actq.adaptive import alam


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
            assert codec is None
        else:
            shape = (4, 128)
            code_bits = 8 * codec.buffers(shape)[0][0]
            assert code_bits == alam.BITS[precision] * 4 * 128
