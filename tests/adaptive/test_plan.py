import json

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.adaptive import BitPlan
from hf_actq.testing import tiny_llama


def _batch():
    ids = torch.randint(
        3, 100, (2, 12), generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    )
    return {"input_ids": ids, "labels": ids}


def _plan_for(handle, setting, act_bits=2):
    return BitPlan(
        {
            s: ({"bits": act_bits} if k == "activation" else dict(setting))
            for s, k in handle.slots.items()
        },
        target_bits=None,
    )


def test_slot_ids_name_module_and_slot():
    handle = hf_actq.apply(tiny_llama(), bits=4)
    assert handle.slots["model.layers.0.self_attn:k"] == "attention"
    assert handle.slots["model.layers.0.mlp:up"] == "mlp"
    assert handle.slots["model.layers.0.mlp:act"] == "activation"
    assert handle.slots["model.layers.1.post_attention_layernorm:input"] == "norm"
    assert handle.slots["model.layers.1.self_attn.o_proj:input"] == "linear"


def test_plans_round_trip_through_json_and_change_what_is_kept(tmp_path):
    model = tiny_llama()
    handle = hf_actq.apply(model, bits=4)
    with SavedTensorMeter(exclude=list(model.parameters())) as four:
        model(**_batch())
    plan = _plan_for(handle, {"codec": "uniform", "bits": 8})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["format"] == "hf_actq.bitplan/1"
    assert BitPlan.load(path) == plan
    handle.revert()
    handle = hf_actq.apply(model, ActQConfig(bits=4, plan=str(path)))
    assert handle.plan == plan
    assert "bits=8" in handle.patched["model.layers.0.self_attn.q_proj"]
    with SavedTensorMeter(exclude=list(model.parameters())) as eight:
        model(**_batch())
    assert eight.nbytes > four.nbytes  # 8-bit codes everywhere


def test_a_plan_for_another_model_is_refused_naming_the_slot(tmp_path):
    model = tiny_llama()
    handle = hf_actq.apply(model, bits=4)
    plan = _plan_for(handle, {"codec": "uniform", "bits": 8})
    del plan.slots["model.layers.1.mlp:gate"]
    with pytest.raises(ValueError, match="no setting for slot 'model.layers.1.mlp:gate'"):
        handle.set_plan(plan)
    plan = _plan_for(handle, {"codec": "uniform", "bits": 8})
    plan.slots["model.layers.7.mlp:gate"] = {"codec": "uniform", "bits": 2}
    with pytest.raises(ValueError, match="names slot 'model.layers.7.mlp:gate'"):
        handle.set_plan(plan)
    handle.revert()
    with pytest.raises(ValueError, match="bit plan .* does not exist"):
        hf_actq.apply(model, ActQConfig(plan=str(tmp_path / "missing.json")))
    assert getattr(model, "_hf_actq_handle", None) is None


def test_per_slot_settings_by_id_and_regex():
    model = tiny_llama()
    config = ActQConfig(
        bits=4,
        slots={
            "re:self_attn:(q|k)$": {"bits": 8},
            "model.layers.0.mlp:act": {"bits": 1},
            "model.layers.0.mlp:up": {"codec": "aq", "bits": 0.5},
        },
    )
    handle = hf_actq.apply(model, config)
    state = handle._states
    assert state["model.layers.1.self_attn:q"][0].codecs["q"].bits == 8
    assert state["model.layers.1.self_attn:v"][0].codecs["v"].bits == 4
    assert state["model.layers.0.mlp:act"][0].activation.bits == 1
    up = state["model.layers.0.mlp:up"][0].codecs["up"]
    assert (up.bits, up.group_size) == (2, 4)
    model(**_batch()).loss.backward()


@pytest.mark.parametrize(
    "slots,match",
    [
        ({"model.layers.0.mlp": {"bits": 2}}, "is not a slot id"),
        ({"re:(": {"bits": 2}}, "is not a valid regex"),
        ({"a:b": {"bitz": 2}}, "must be a dict with keys among"),
        ({"a:b": {"bits": 9}}, r"slots\['a:b'\]: bits must be"),
    ],
)
def test_bad_slot_settings_are_clear_errors(slots, match):
    with pytest.raises(ValueError, match=match):
        ActQConfig(slots=slots)


def test_few_bit_slots_take_bits_one_to_four():
    with pytest.raises(ValueError, match="few-bit slots take bits 1..4"):
        hf_actq.apply(tiny_llama(), ActQConfig(slots={"re::act$": {"bits": 8}}))


def test_a_standalone_activation_can_keep_its_input_with_a_codec():
    # ALAM's way for GELU: its input under a quantizer, the exact derivative taken at the
    # dequantized input; plans switch an "act" slot between that and a few-bit code.
    from hf_actq.codecs import AverageQuantCodec
    from hf_actq.codecs.packed import ExactCodec
    from hf_actq.testing import tiny_bert

    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.tensor([0, 1])}
    model(**batch).loss.backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    act = "bert.encoder.layer.0.intermediate.intermediate_act_fn:act"
    config = ActQConfig.from_recipe(
        "fewbit", share_norm_outputs=False, slots={"re::act$": {"codec": "exact"}}
    )
    handle = hf_actq.apply(model, config)
    state = handle._states[act][0]
    assert isinstance(state.codecs["act"], ExactCodec)
    assert handle.patched[act.split(":")[0]] == "activation gelu input ExactCodec()"
    model(**batch).loss.backward()  # the input kept exactly: the stock gradient
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), exact, strict=True))
    aq = {"codec": "aq", "bits": 0.5, "group_size": 4}
    handle.set_plan(BitPlan({s: dict(aq) for s in handle.slots}))
    assert state.codecs["act"] == AverageQuantCodec(bits=2, group_size=4)
    handle.set_plan(_plan_for(handle, aq, act_bits=2))
    assert "act" not in state.codecs and state.activation.bits == 2
    handle.revert()


def test_a_gated_mlps_activation_keeps_a_few_bit_code():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"slots\['model.layers.0.mlp:act'\]: only a standalone"):
        hf_actq.apply(model, ActQConfig(slots={"re::act$": {"codec": "uniform", "bits": 4}}))
    handle = hf_actq.apply(model, bits=4)
    plan = BitPlan({s: {"codec": "uniform", "bits": 4} for s in handle.slots})
    with pytest.raises(ValueError, match="only a standalone activation can keep its input"):
        handle.set_plan(plan)
    handle.revert()
