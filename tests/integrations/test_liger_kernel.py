"""Models whose norms, MLPs and loss run Liger-Kernel's forwards, bound onto the instances
(``_apply_liger_kernel_to_instance``, which ``Trainer(use_liger_kernel=True)`` runs in
``train()``): those modules keep Liger's forward, named in one warning; an MLP's activation that
Liger's SwiGLU never calls is not claimed; forwards bound after apply are found, and the callback
applies again around them.

Liger's kernels need a GPU: the step tests bind forwards of Liger's shape computed in PyTorch
(plain functions naming the children they call, as Liger's do); the real library, where
installed, is checked for what apply and revert do with it."""

import copy
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

import hf_actq
from hf_actq import ActQCallback, ActQConfig
from hf_actq.testing import metered_step, more_model, short_training, tiny_batch, tiny_model


def swiglu_forward(self, x):
    """LigerSwiGLUMLP.forward's shape: the activation inside its own product, act_fn unused."""
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rms_norm_forward(self, x):
    """LigerRMSNorm.forward's place: a norm computed in a function of the library's own."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


def bind_like_liger(model) -> None:
    """What Liger's instance patching does to a LLaMA: forwards bound onto each MLP and norm."""
    for module in model.modules():
        name = type(module).__name__
        if name == "LlamaMLP":
            module.forward = types.MethodType(swiglu_forward, module)
        elif name == "LlamaRMSNorm":
            module.forward = types.MethodType(rms_norm_forward, module)


def _bound_here(model, library="liger_kernel") -> dict[str, object]:
    """The forwards bound on the instances by the library (Liger's, or this file's)."""
    found = {}
    for path, module in model.named_modules():
        function = getattr(module.__dict__.get("forward"), "__func__", None)
        if getattr(function, "__module__", "").startswith((library, __name__)):
            found[path] = function
    return found


def _liger_like_paths(model) -> set[str]:
    return {
        path
        for path, module in model.named_modules()
        if type(module).__name__ in ("LlamaMLP", "LlamaRMSNorm")
    }


def test_forwards_bound_by_another_library_are_kept_and_named_in_one_warning(caplog):
    model, batch = tiny_model("llama"), tiny_batch("llama")
    bind_like_liger(model)
    bound = _bound_here(model)
    reference = copy.deepcopy(model)
    want_forward, want_grads, _ = metered_step(reference, batch)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    warnings = [r.getMessage() for r in caplog.records if "another library" in r.getMessage()]
    assert warnings == [
        f"hf_actq: {len(bound)} modules run a forward that another library set on the instance, "
        "which hf_actq leaves as it is (what that forward keeps for backward stays as it was): "
        f"swiglu_forward from {__name__.split('.')[0]} on 2 (model.layers.0.mlp, ...); "
        f"rms_norm_forward from {__name__.split('.')[0]} on 5 "
        "(model.layers.0.input_layernorm, ...)"
    ]
    assert set(bound) == _liger_like_paths(model)
    for path in bound:
        assert handle.skipped[path].endswith(
            ("swiglu_forward from " if path.endswith("mlp") else "rms_norm_forward from ")
            + __name__.split(".")[0]
        )
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        # Never called by the bound forward: not claimed, not counted as patched.
        assert handle.skipped[f"{mlp}.act_fn"] == (
            "not called by its parent's forward, swiglu_forward from " + __name__.split(".")[0]
        )
        assert f"{mlp}.act_fn" not in handle.patched
        for projection in ("gate_proj", "up_proj", "down_proj"):
            assert handle.patched[f"{mlp}.{projection}"].startswith("linear"), projection
    assert "not called by its parent's forward" in handle.explain()
    assert handle.unbound() == []
    forward, grads, _ = metered_step(model, batch)
    assert torch.equal(forward, want_forward)  # the bound forwards ran, exactly
    for got, want in zip(grads, want_grads):
        assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
    handle.revert()
    assert _bound_here(model) == bound
    assert torch.equal(metered_step(model, batch)[0], want_forward)


def test_forwards_bound_after_apply_are_found_and_revert_leaves_them(caplog):
    model = tiny_model("llama")
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    assert handle.unbound() == []
    bind_like_liger(model)  # what Trainer(use_liger_kernel=True) does in train()
    bound = _bound_here(model)
    assert set(handle.unbound()) == _liger_like_paths(model)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        handle.revert()
    warnings = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert warnings == [
        f"hf_actq: {len(bound)} patched modules had their forward replaced after apply "
        "(model.layers.0.mlp first); what replaced it stays"
    ]
    # The library's forwards stay; every other module is stock again.
    assert _bound_here(model) == bound
    assert [p for p, m in model.named_modules() if "forward" in m.__dict__] == list(bound)


def test_a_wrapper_that_calls_another_forward_leaves_the_children_patched():
    """A forward set on the instance that reaches its children some other way than by name
    (here: the class's forward) leaves them patched, as before."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(
            lambda self, x: type(self).forward(self, x) * 1.0, layer.mlp
        )
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    assert handle.patched["model.layers.0.mlp.act_fn"].startswith("activation")
    assert "model.layers.0.mlp.act_fn" not in handle.skipped
    handle.revert()


def test_the_callback_applies_again_around_forwards_bound_in_train(tmp_path, monkeypatch, caplog):
    """``Trainer(use_liger_kernel=True)`` binds Liger's forwards in ``train()``, after the
    callback patched at init: before the first step the callback applies again, so that the
    gated MLPs' projections are compressed under Liger's forward and nothing counts as patched
    that does not run hf_actq's op."""
    import transformers.trainer

    applied = []
    monkeypatch.setattr(
        transformers.trainer,
        "apply_liger_kernel",
        lambda model, config: applied.append(bind_like_liger(model)),
    )
    batch = tiny_batch("llama")
    dataset = [{"input_ids": ids, "labels": ids} for ids in batch["input_ids"]]
    callback = ActQCallback(recipe="uniform")
    trainer = Trainer(
        model=tiny_model("llama"),
        args=short_training(str(tmp_path), steps=2, use_liger_kernel=True),
        train_dataset=dataset,
        callbacks=[callback],
    )
    assert "model.layers.0.mlp" in callback.handle.patched  # the gated op, before train()
    with caplog.at_level(logging.INFO, logger="hf_actq"):
        trainer.train()
    assert applied == [None]
    handle = callback.handle
    assert handle.unbound() == []
    assert handle.skipped["model.layers.0.mlp"].startswith("a forward another library set")
    assert handle.patched["model.layers.0.mlp.gate_proj"].startswith("linear")
    assert "model.layers.0.mlp.act_fn" not in handle.patched
    lines = [r.getMessage() for r in caplog.records if "applied again" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"hf_actq: {len(_liger_like_paths(trainer.model))} patched modules were bound to other "
        "forwards after apply (model.layers.0.mlp first"
    )
    assert callback.memory_history and callback.memory_history[0]["activation_bytes"] > 0


def fused_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """LigerExperts.forward's place: experts computed by a function of the library's own (here
    the class's, which a real library's kernel replaces)."""
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights)


def _experts(model) -> dict[str, torch.nn.Module]:
    return {p: m for p, m in model.named_modules() if p.endswith("mlp.experts")}


def test_experts_with_a_forward_set_on_the_instance_are_left_to_it():
    """Experts are patched through transformers' experts interface, which their class's forward
    calls: a forward set on the instance (Liger's fused experts) goes around it, so they are
    not counted patched, and one bound after apply is found."""
    model, batch = more_model("qwen3_moe")
    experts = _experts(model)
    for module in experts.values():
        module.forward = types.MethodType(fused_experts_forward, module)
    reference = copy.deepcopy(model)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    for path in experts:
        assert handle.skipped[path].endswith("fused_experts_forward from " + __name__.split(".")[0])
        assert path not in handle.patched
    assert torch.equal(model(**batch).loss, reference(**batch).loss)
    handle.revert()

    model, _ = more_model("qwen3_moe")
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    assert all(path in handle.patched for path in _experts(model))
    for module in _experts(model).values():
        module.forward = types.MethodType(fused_experts_forward, module)
    assert set(handle.unbound()) == set(_experts(model))
    handle.revert()


@pytest.fixture
def liger_instance_patching(monkeypatch):
    """Liger-Kernel's ``_apply_liger_kernel_to_instance``, with the module globals it also
    replaces (the rotary function, the norm, MLP and experts classes) put back afterwards."""
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    for module in (modeling_llama, modeling_qwen3_moe):
        for name, value in list(vars(module).items()):
            monkeypatch.setattr(module, name, value)
    return monkey_patch._apply_liger_kernel_to_instance


def test_liger_kernels_forwards_are_kept_and_named(liger_instance_patching, caplog):
    model = tiny_model("llama")
    liger_instance_patching(model=model)
    bound = _bound_here(model)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    (warning,) = [r.getMessage() for r in caplog.records if "another library" in r.getMessage()]
    for forward in ("lce_forward", "LigerSwiGLUMLP.forward", "LigerRMSNorm.forward"):
        assert f"{forward} from liger_kernel on " in warning
    assert handle.skipped[""].endswith("lce_forward from liger_kernel")
    assert handle.skipped["model.layers.0.mlp.act_fn"].startswith("not called by its parent")
    assert handle.patched["model.layers.0.mlp.up_proj"].startswith("linear")
    assert handle.unbound() == []
    handle.revert()
    assert _bound_here(model) == bound


def test_liger_kernel_bound_after_apply_is_found(liger_instance_patching):
    model = tiny_model("llama")
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    liger_instance_patching(model=model)
    assert set(handle.unbound()) == {"", *_liger_like_paths(model)}
    bound = _bound_here(model)
    handle.revert()
    assert _bound_here(model) == bound


def test_liger_kernels_fused_experts_are_kept(liger_instance_patching):
    model, _ = more_model("qwen3_moe")
    liger_instance_patching(model=model)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    for path in _experts(model):
        assert handle.skipped[path].endswith("LigerExperts.forward from liger_kernel")
    assert not any(description.startswith("moe_experts") for description in handle.patched.values())
    handle.revert()
