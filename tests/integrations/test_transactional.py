"""``apply``, ``set_plan`` and ``calibrate`` are all or nothing: whatever fails part-way, the
model is left exactly as it was (no instance attribute, hook or config change left; forward and
backward bit-identical), and a patched model that is pickled says what to do instead."""

import io
import pickle

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig
from hf_actq.adaptive.plan import BitPlan
from hf_actq.integrations import layers, transformers
from hf_actq.ops.state import STATE
from hf_actq.testing import tiny_bert, tiny_llama


def _snapshot(model):
    """Every module's instance attributes by identity, and the contents of its dicts (hooks,
    parameters, submodules), plus the config's attention implementation."""
    state = {}
    for path, module in model.named_modules():
        entry = {}
        for name, value in module.__dict__.items():
            if isinstance(value, dict):
                entry[name] = tuple((key, id(item)) for key, item in value.items())
            elif isinstance(value, (bool, int, float, str, type(None))):
                entry[name] = value
            else:
                entry[name] = id(value)
        state[path] = entry
    config = getattr(model, "config", None)
    state["config"] = getattr(config, "_attn_implementation", None)
    return state


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _llama_batch():
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _bert_batch():
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": torch.tensor([0, 1])}


def _assert_untouched(model, batch, before, expected):
    assert _snapshot(model) == before
    assert getattr(model, "_hf_actq_handle", None) is None
    loss, grads = _step(model, batch)
    assert torch.equal(loss, expected[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, expected[1], strict=True))


def test_a_plan_whose_few_bit_setting_lacks_bits_changes_nothing():
    # The case: a KeyError deep in set_plan left 17 forwards bound and no handle.
    model, batch = tiny_llama(), _llama_batch()
    expected, before = _step(model, batch), _snapshot(model)
    handle = hf_actq.apply(model, bits=4)
    plan = BitPlan({slot: {"codec": "uniform", "bits": 4} for slot in handle.slots})
    act = next(slot for slot in plan.slots if slot.endswith(":act"))
    plan.slots[act] = {}
    handle.revert()
    with pytest.raises(ValueError, match=rf"bit plan: slot '{act}': a few-bit slot's setting"):
        hf_actq.apply(model, ActQConfig(bits=4, plan=plan))
    _assert_untouched(model, batch, before, expected)
    hf_actq.apply(model, bits=4).revert()  # and it can be patched again
    _assert_untouched(model, batch, before, expected)


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=repr)
@pytest.mark.parametrize(
    ("make", "batch", "recipe"),
    [(tiny_llama, _llama_batch, "uniform"), (tiny_bert, _bert_batch, "checkpoint")],
)
@pytest.mark.parametrize("where", ["a patcher half-way", "the last step"])
def test_any_failure_during_apply_leaves_the_model_as_it_was(
    make, batch, recipe, where, error, monkeypatch
):
    model, batch = make(), batch()
    expected, before = _step(model, batch), _snapshot(model)
    if where == "a patcher half-way":
        calls = []
        original = layers.slot_codec

        def failing(*args):
            calls.append(1)
            if len(calls) == 2:
                raise error
            return original(*args)

        monkeypatch.setattr(layers, "slot_codec", failing)
    else:

        def failing(*args):
            raise error

        monkeypatch.setattr(transformers, "support_data_parallel", failing)
    with pytest.raises(type(error)):
        hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    monkeypatch.undo()
    _assert_untouched(model, batch, before, expected)


def test_a_plan_with_a_bad_setting_changes_no_slot():
    model = tiny_llama()
    handle = hf_actq.apply(model, bits=4)
    codecs = {slot: state.codecs.get(name) for slot, (state, name) in handle._states.items()}
    plan = BitPlan({slot: {"codec": "uniform", "bits": 2} for slot in handle.slots})
    for slot in plan.slots:
        if slot.endswith(":act"):
            plan.slots[slot] = {"bits": 2}
    last = sorted(s for s in plan.slots if not s.endswith(":act"))[-1]
    plan.slots[last] = {"codec": "uniform", "bits": 2, "sizes": 3}
    with pytest.raises(ValueError, match=rf"slot '{last}': a setting must be a dict with keys"):
        handle.set_plan(plan)
    assert handle.plan is None
    after = {slot: state.codecs.get(name) for slot, (state, name) in handle._states.items()}
    assert after == codecs
    assert all(
        state.activation.bits == 4 for state, name in handle._states.values() if name == "act"
    )
    handle.revert()


def test_calibration_refuses_a_batch_with_no_supervised_token():
    model, batch = tiny_llama(), _llama_batch()
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam", bits=2))
    before = {slot: state.codecs.get(name) for slot, (state, name) in handle._states.items()}
    empty = dict(batch, labels=torch.full_like(batch["labels"], -100))
    with pytest.raises(ValueError, match="the loss on this batch is nan"):
        handle.calibrate(empty)
    assert handle.plan is None
    assert {s: st.codecs.get(n) for s, (st, n) in handle._states.items()} == before
    assert all(p.grad is None for p in model.parameters())
    plan = handle.calibrate(batch)  # a batch with labels works
    assert handle.plan is plan
    handle.revert()


def test_calibration_refuses_nan_inputs():
    model, batch = tiny_bert(), _bert_batch()
    handle = hf_actq.apply(model, ActQConfig.from_recipe("alam", bits=2))
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    embeds[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="calibration"):
        handle.calibrate(dict(batch, inputs_embeds=embeds))
    assert handle.plan is None
    handle.revert()


@pytest.mark.parametrize("recipe", ["uniform", "checkpoint", "fewbit"])
def test_pickling_a_patched_model_says_to_revert_first(recipe):
    model, batch = tiny_llama(), _llama_batch()
    handle = hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    _step(model, batch)  # the packing caches now hold weak references
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match=r"call handle.revert\(\).*save_pretrained"):
            save(model)
    patched = next(m for m in model.model.modules() if STATE in m.__dict__)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(patched)  # a patched submodule says the same
    handle.revert()
    pickle.loads(pickle.dumps(model))
