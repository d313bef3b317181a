import logging
import statistics

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig
from hf_actq.adaptive.calibrate import calibrate, list_slots, spread_order
from hf_actq.testing import tiny_llama


def _batch(seed=1, rows=4):
    ids = torch.randint(
        3, 100, (rows, 12), generator=torch.Generator(torch.get_default_device()).manual_seed(seed)
    )
    return {"input_ids": ids, "labels": ids}


def _patched(bits=1, **extra):
    # ALAM's plan and its arithmetic are tested in tests/adaptive/test_alam.py; here the pass.
    model = tiny_llama()
    return model, hf_actq.apply(model, ActQConfig.from_recipe("alam", bits=bits, **extra))


def test_list_slots_reports_shapes_bytes_and_shared_inputs():
    _, handle = _patched()
    infos = list_slots(handle, _batch())
    q = infos["model.layers.0.self_attn.q_proj:input"]
    k = infos["model.layers.0.self_attn.k_proj:input"]
    assert q.shape == (4, 12, 32) and q.shared_with is None
    assert k.shared_with == "model.layers.0.self_attn.q_proj:input"  # one packed x for q, k, v
    # GQA: 2 kv heads; K packed transposed, as ALAM's code packs it (groups along the sequence)
    assert infos["model.layers.0.self_attn:k"].shape == (4, 2, 8, 12)
    assert infos["model.layers.0.mlp:act"].nbytes == (4 * 12 * 64 + 7) // 8 + 4
    assert set(infos) <= set(handle.slots)


def test_calibration_is_deterministic():
    plans = []
    for _ in range(2):
        _, handle = _patched()
        plans.append(handle.calibrate(_batch()))
    assert plans[0].slots == plans[1].slots
    assert plans[0].info["sensitivity"] == plans[1].info["sensitivity"]


def test_spread_order_takes_every_index_once_and_each_prefix_spreads_over_the_range():
    for n in range(40):
        assert sorted(spread_order(n)) == list(range(n))
    assert spread_order(9)[:3] == [0, 8, 4]
    assert spread_order(9)[:5] == [0, 8, 4, 2, 6]


def test_a_slot_count_measures_each_kind_once_before_any_twice_and_estimates_the_rest():
    _, handle = _patched()  # calibrate() returns plans without installing them: one context
    full = calibrate(handle, _batch()).info
    kinds = {slot: handle.slots[slot] for slot in full["sensitivity"]}
    capped = calibrate(handle, _batch(), slots=len(set(kinds.values()))).info
    assert capped["measured"] == len(set(kinds.values()))
    assert capped["estimated"] == len(kinds) - capped["measured"] > 0
    # Measuring does not depend on the order or the cap: the measured tensors match the full
    # pass, one of each kind; every other tensor takes its kind's measured value.
    same = [s for s, v in capped["sensitivity"].items() if v == full["sensitivity"][s]]
    assert sorted(kinds[s] for s in same) == sorted(set(kinds.values()))
    for slot, value in capped["sensitivity"].items():
        assert value == statistics.median(
            capped["sensitivity"][s] for s in same if kinds[s] == kinds[slot]
        )
    # A count that covers every tensor is the uncapped pass, plan and all.
    every = calibrate(handle, _batch(), slots=len(kinds))
    assert every.info["sensitivity"] == full["sensitivity"]
    assert every.slots == calibrate(handle, _batch()).slots


def test_calibration_leaves_rng_optimizer_and_accumulated_gradients_untouched():
    model, handle = _patched()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**_batch(2)).loss.backward()
    optimizer.step()  # Adam has state now
    model(**_batch(3)).loss.backward()  # a micro-batch accumulated, not stepped yet
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = {n: g.clone() for n, g in grads.items()}
    adam = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state.items()}
    rng = torch.get_rng_state()
    handle.calibrate(_batch())
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert p.grad is grads[n] and torch.equal(p.grad, values[n])
    for key, state in optimizer.state.items():
        assert all(torch.equal(t, adam[key][n]) for n, t in state.items())


def test_adaptive_config_warns_until_calibrated_and_validates_its_options(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        _patched()
    assert "handle.calibrate(batch)" in caplog.text
    with pytest.raises(ValueError, match="calibration_examples must be a positive integer"):
        ActQConfig(adaptive=True, calibration_examples=0)
    with pytest.raises(ValueError, match="calibration_slots must be a positive integer"):
        ActQConfig(adaptive=True, calibration_slots=0)
    with pytest.raises(ValueError, match="calibration_slots must be a positive integer"):
        ActQConfig(adaptive=True, calibration_slots=True)
    with pytest.raises(ValueError, match="recalibrate_at must be in"):
        ActQConfig(recalibrate_at=1.5)


def test_activations_kept_few_bit_count_toward_the_budget_and_the_rest_is_allocated():
    from hf_actq.testing import tiny_bert

    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.tensor([0, 1])}
    plans = {}
    for allocate in (True, False):
        model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config = ActQConfig.from_recipe("alam", bits=2, allocate_activations=allocate)
        handle = hf_actq.apply(model, config)
        plans[allocate] = handle.calibrate(batch, seconds=float("inf"))
        acts = [s for s in handle.slots if s.endswith(":act")]
        # what the pass measured is what training runs: a few-bit code, not a codec
        assert all(("act" in handle._states[s][0].codecs) == allocate for s in acts)
        handle.revert()
    assert len(acts) == 2
    allocated, kept = plans[True], plans[False]
    assert all("codec" in allocated.slots[s] for s in acts)
    assert all(s in allocated.info["sensitivity"] for s in acts)
    assert all(kept.slots[s] == {"bits": 2} for s in acts)
    assert not any(s in kept.info["sensitivity"] for s in acts)
    # the two-bit codes count: the rest gets what is left of the same average
    assert kept.info["budget_met"] and allocated.info["budget_met"]
    assert (
        kept.info["alam_bits"] <= 2 and kept.info["budget_bytes"] == allocated.info["budget_bytes"]
    )
    others = list(kept.info["sensitivity"])
    assert others and set(others) == set(allocated.info["sensitivity"]) - set(acts)
    # a GELU given a codec by the user's slots is set back to the few-bit code it is counted as
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    aq = {"re::act$": {"codec": "aq", "bits": 2}}
    config = ActQConfig.from_recipe("alam", bits=2, allocate_activations=False, slots=aq)
    handle = hf_actq.apply(model, config)
    plan = handle.calibrate(batch, seconds=float("inf"))
    assert all(plan.slots[s] == {"bits": 2} for s in acts)
    handle.revert()
    with pytest.raises(ValueError, match="allocate_activations=False changes only adaptive"):
        ActQConfig(allocate_activations=False)


def test_retired_allocator_options_say_why_and_old_configs_still_load():
    with pytest.raises(ValueError, match="sensitivity='gradvar' is no longer supported: our own"):
        ActQConfig.from_recipe("alam", sensitivity="gradvar")
    with pytest.raises(ValueError, match="chain_bits=4 is no longer supported"):
        ActQConfig(adaptive=True, chain_bits=4)
    # Configs saved before (a run's results) load where the fields meant today's behaviour:
    # ALAM's sensitivity and no floor, or any value on a config that is not adaptive.
    saved = {**ActQConfig.from_recipe("alam").to_dict(), "sensitivity": "alam", "chain_bits": None}
    assert ActQConfig.from_dict(saved) == ActQConfig.from_recipe("alam")
    saved = {**ActQConfig.from_recipe("fewbit").to_dict(), "sensitivity": "gradvar"}
    assert ActQConfig.from_dict(saved) == ActQConfig.from_recipe("fewbit")


def test_calibration_needs_a_loss():
    _, handle = _patched()
    with pytest.raises(ValueError, match="calibration needs the model's loss"):
        handle.calibrate({"input_ids": _batch()["input_ids"]})


def test_a_pass_cut_by_its_time_cap_says_so_and_one_cut_by_its_count_does_not(caplog):
    _, handle = _patched()
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        by_time = calibrate(handle, _batch(), seconds=1e-9).info
    assert by_time["estimated"] > 0
    assert "calibration reached its time cap" in caplog.text
    assert f"after measuring {by_time['measured']} of " in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        assert calibrate(handle, _batch(), slots=2).info["estimated"] > 0
    assert "time cap" not in caplog.text


def test_a_model_in_eval_mode_is_measured_in_training_mode_and_left_in_eval():
    # Nothing is compressed in eval: measured there, every slot would look insensitive.
    model, handle = _patched()
    want = handle.calibrate(_batch()).slots
    model.eval()
    model.model.layers[0].train()  # a mixed state is put back as it was
    assert handle.calibrate(_batch()).slots == want
    assert not model.training and model.model.layers[0].training
    assert not model.model.layers[1].training


@pytest.mark.parametrize(
    "backend,device", [("nccl", "cuda:1"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu")]
)
def test_ranks_reduce_on_the_device_their_backend_takes(backend, device, monkeypatch):
    # accelerate launch on GPUs starts an NCCL group, which reduces CUDA tensors only: a CPU
    # tensor there fails ("No backend type associated with device type cpu").
    from hf_actq.adaptive import calibrate as module

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert module._collective_device() == torch.device(device)
