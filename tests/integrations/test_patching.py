"""Patching modules that already carry an instance-level forward: accelerate's hooks (as set by
``from_pretrained(..., device_map=...)``) keep running, and revert restores every forward."""

import logging

import pytest
import torch
from torch import nn

import hf_actq
from hf_actq.testing import tiny_llama as _llama

accelerate_hooks = pytest.importorskip("accelerate.hooks")


class _Count(accelerate_hooks.ModelHook):
    def __init__(self):
        self.calls: dict[str, int] = {}

    def pre_forward(self, module, *args, **kwargs):
        self.calls[module.hf_path] = self.calls.get(module.hf_path, 0) + 1
        return args, kwargs


def _hooked_llama():
    """A LLaMA with accelerate's AlignDevicesHook on every leaf (what a device-map load
    attaches) and a counting hook chained after it."""
    model = _llama()
    accelerate_hooks.attach_align_device_hook(model, execution_device=torch.device("cpu"))
    counter = _Count()
    for path, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            module.hf_path = path
            accelerate_hooks.add_hook_to_module(module, counter, append=True)
    return model, counter


def _forwards(model):
    return {
        path: (module.__dict__.get("forward"), module.__dict__.get("_old_forward"))
        for path, module in model.named_modules()
    }


def _step(model, ids):
    model.zero_grad()
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_accelerate_hooks_keep_running_and_revert_restores_them():
    ids = torch.randint(
        3, 100, (2, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    )
    model, counter = _hooked_llama()
    loss, expected = _step(model, ids)
    unpatched_calls = dict(counter.calls)
    before = _forwards(model)
    handle = hf_actq.apply(model, bits=8)
    counter.calls.clear()
    patched_loss, grads = _step(model, ids)
    assert counter.calls == unpatched_calls  # every hook ran, as often as without hf_actq
    assert any(d.startswith("gated_mlp") for d in handle.patched.values())
    assert ".mlp.down_proj" in "".join(handle.patched)  # a hooked projection runs as a module
    assert torch.equal(patched_loss, loss)
    for got, want in zip(grads, expected):
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
    handle.revert()
    after = _forwards(model)
    for path, (forward, old_forward) in before.items():
        assert after[path][0] is forward and after[path][1] is old_forward, path
    assert torch.equal(_step(model, ids)[0], loss)


def test_hooks_added_or_removed_after_apply_survive_revert():
    ids = torch.randint(
        3, 100, (2, 8), generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    )
    model = _llama()
    handle = hf_actq.apply(model, bits=4)
    added = model.model.layers[0].self_attn.q_proj
    counter = _Count()
    added.hf_path = "q"
    accelerate_hooks.add_hook_to_module(added, counter)
    removed = model.model.layers[0].self_attn.k_proj
    accelerate_hooks.add_hook_to_module(removed, accelerate_hooks.ModelHook())
    accelerate_hooks.remove_hook_from_module(removed)
    # The input embedding carries the step seed's forward (see hf_actq.ops.dedup).
    embedding = model.get_input_embeddings()
    accelerate_hooks.add_hook_to_module(embedding, accelerate_hooks.ModelHook())
    handle.revert()
    # The later hook still wraps the stock forward; the removed one left no trace of hf_actq.
    assert added.__dict__["_old_forward"].__func__ is nn.Linear.forward
    assert embedding.__dict__["_old_forward"].__func__ is nn.Embedding.forward
    assert "_hf_actq" not in added.__dict__ and "_hf_actq" not in removed.__dict__
    assert removed.forward.__func__ is nn.Linear.forward
    model(input_ids=ids, labels=ids).loss.backward()
    assert counter.calls == {"q": 1}


def test_an_unknown_instance_forward_is_left_alone_with_a_warning(caplog):
    model = _llama()
    mine = model.model.layers[0].self_attn.o_proj

    def wrapped(x):
        return nn.Linear.forward(mine, x)

    mine.forward = wrapped
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        handle = hf_actq.apply(model, bits=4)
    assert mine.forward is wrapped
    assert handle.skipped["model.layers.0.self_attn.o_proj"] == (
        "a forward another library set on the instance: "
        "test_an_unknown_instance_forward_is_left_alone_with_a_warning.<locals>.wrapped from "
        + __name__.split(".")[0]
    )
    assert [r.getMessage() for r in caplog.records] == [
        "hf_actq: 1 module runs a forward that another library set on the instance, which "
        "hf_actq leaves as it is (what that forward keeps for backward stays as it was): "
        "test_an_unknown_instance_forward_is_left_alone_with_a_warning.<locals>.wrapped from "
        f"{__name__.split('.')[0]} on 1 (model.layers.0.self_attn.o_proj)"
    ]
    handle.revert()
    assert mine.forward is wrapped


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_a_model_forward_wrapped_after_apply_runs_stock_once_reverted(name):
    """``Trainer(bf16=True)`` has accelerate wrap ``model.forward`` (autocast, fp32 outputs)
    after ``ActQCallback`` applied, and TRL's SFTTrainer wraps it with its fused LM head:
    revert cannot take hf_actq's loss forward out of such a wrapper, so that forward must run
    the stock one from then on (it raised a KeyError before)."""
    import copy

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_actq.testing import more_model

    if name == "llama":
        model = _llama()
        ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
        batch = dict(input_ids=ids, labels=ids)
    else:
        model, batch = more_model("bart")
    reference = copy.deepcopy(model)
    # A process-wide state: an earlier test's (without mixed precision) would refuse bf16.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        reference = accelerator.prepare(reference)
        expected = reference(**batch)
        handle = hf_actq.apply(model, bits=4)
        model = accelerator.prepare(model)
        assert "forward" in model.__dict__  # the wrapper, around hf_actq's forward
        patched = model(**batch)
        assert patched.logits is None  # the fused loss ran inside the wrapper
        patched.loss.backward()
        handle.revert()
        reverted = model(**batch)
        assert torch.equal(reverted.loss, expected.loss)
        assert torch.equal(reverted.logits, expected.logits)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_fused_gated_mlps_are_zero3_leaf_modules_until_revert():
    # The fused MLP reads its projections' weights without calling them: DeepSpeed ZeRO-3 must
    # gather them with the MLP (tests/integrations/test_deepspeed.py runs it).
    model = _llama()
    handle = hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform"))
    leaves = [path for path, module in model.named_modules() if module.__dict__.get("_z3_leaf")]
    assert leaves == ["model.layers.0.mlp", "model.layers.1.mlp"]
    handle.revert()
    assert not any("_z3_leaf" in module.__dict__ for module in model.modules())


def test_models_built_from_one_config_are_patched_each_on_its_own():
    """``from_config`` keeps the config object: every model built from it shares it, and
    pointing it at the compressed attention reached them all. Each model is now patched (or
    not) on its own: a second model is compressed too, an unpatched one runs stock attention,
    and the config names the stock implementation again once the last patched model reverts."""
    from transformers import AutoModelForCausalLM

    from hf_actq.testing import tiny_llama_config

    config = tiny_llama_config()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).train()

    def kept(model):
        with hf_actq.SavedTensorMeter(exclude=list(model.parameters())) as meter:
            output = model(input_ids=ids, labels=ids)
        return meter.nbytes, output.loss

    stock_bytes, stock_loss = kept(build())
    first, second, bystander = build(), build(), build()
    first_handle = hf_actq.apply(first, hf_actq.ActQConfig.from_recipe("uniform"))
    second_handle = hf_actq.apply(second, hf_actq.ActQConfig.from_recipe("uniform"))
    assert "attention" not in second_handle.skipped
    assert kept(second)[0] == kept(first)[0] < stock_bytes
    assert kept(bystander) == (stock_bytes, stock_loss)  # built before, never patched
    first_handle.revert()
    assert config._attn_implementation != "sdpa"  # the second model still runs patched
    assert kept(second)[0] < kept(first)[0] == stock_bytes
    second_handle.revert()
    assert config._attn_implementation == "sdpa"
    assert kept(second)[0] == stock_bytes
