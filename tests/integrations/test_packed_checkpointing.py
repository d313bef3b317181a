"""``checkpoint_bits`` / the "checkpoint" recipe on stock models: checkpointing turned on with
packed layer inputs, exact forward, close gradients, fewer bytes than stock checkpointing,
revert, Trainer, LoRA, T5's keyword position bias, and a clear warning where nothing can be
checkpointed."""

import functools
import logging

import pytest
import torch
from test_trainer import Toy, _args, _bert
from transformers import Trainer

import hf_actq
from hf_actq import ActQCallback, ActQConfig, SavedTensorMeter
from hf_actq.integrations.checkpointing import checkpointed_layers
from hf_actq.ops.packed_checkpoint import packed_checkpoint
from hf_actq.testing import (
    checkpointing_argument,
    more_model,
    stock_checkpointing,
    tiny_llama,
    tiny_model,
)


def _step(model, batch):
    model.zero_grad()
    params = list(model.parameters())
    with SavedTensorMeter(exclude=params) as meter:
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params if p.grad is not None], meter.nbytes


def _cosine(a, b) -> float:
    if a.norm() < 1e-8:  # a gradient that is zero up to rounding (BERT's key bias)
        return 1.0 if b.norm() < 1e-6 else 0.0
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def _is_packed(layer) -> bool:
    func = layer.__dict__.get("_gradient_checkpointing_func")
    return isinstance(func, functools.partial) and func.func is packed_checkpoint


def _longer_batch(model_type):
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (4, 64))
    return dict(input_ids=ids, labels=torch.tensor([0, 1, 1, 0]) if model_type == "bert" else ids)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_checkpoint_recipe_keeps_the_loss_and_close_gradients_in_fewer_bytes(model_type):
    model = tiny_model(model_type)
    batch = _longer_batch(model_type)
    loss, grads, nbytes = _step(model, batch)
    stock_checkpointing(model)
    _, stock_grads, stock_bytes = _step(model, batch)
    stock_checkpointing(model, on=False)

    handle = hf_actq.apply(model, ActQConfig.from_recipe("checkpoint", bits=8))
    layers = checkpointed_layers(model)
    assert len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers.values())
    assert all(_is_packed(layer) for layer in layers.values())
    assert handle.checkpointed.keys() == layers.keys()
    # Stock inside the layers; the rest (embeddings, head) compressed.
    assert handle.patched and not any(path.startswith(tuple(layers)) for path in handle.patched)
    packed_loss, packed_grads, packed_bytes = _step(model, batch)
    # Exact forward (a decoder's fused loss sums its token chunks in another order: 1 ulp).
    assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-6, abs=0)
    for exact, packed in zip(grads, packed_grads, strict=True):
        assert _cosine(exact, packed) > 0.99
    # 8-bit layer inputs: well under stock checkpointing's full-precision ones.
    assert packed_bytes < 0.5 * stock_bytes < 0.5 * nbytes
    del stock_grads

    handle.revert()
    assert not any(layer.gradient_checkpointing for layer in layers.values())
    assert not any(_is_packed(layer) for layer in layers.values())
    reverted_loss, reverted_grads, reverted_bytes = _step(model, batch)
    assert reverted_loss == loss and reverted_bytes == nbytes
    for exact, again in zip(grads, reverted_grads, strict=True):
        torch.testing.assert_close(exact, again, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_compress_checkpointed_also_patches_inside_the_layers_and_revert_keeps_stock_checkpointing(
    model_type,
):
    """With the ops inside compressed too (their packs happen in the recompute, norm outputs
    shared with the next linears there), 8 bits everywhere keeps every gradient close (few-bit
    activations off: their 4-bit derivative alone turns a tiny model's gradients by more)."""
    model = tiny_model(model_type)
    batch = _longer_batch(model_type)
    _, exact, _ = _step(model, batch)
    stock_checkpointing(model)
    layer = next(iter(checkpointed_layers(model).values()))
    stock_func = layer._gradient_checkpointing_func
    handle = hf_actq.apply(model, ActQConfig(bits=8, activations=False, checkpoint_bits=8))
    assert any(".0." in path for path in handle.patched)
    _, grads, _ = _step(model, batch)
    for a, b in zip(exact, grads, strict=True):
        assert _cosine(a, b) > 0.99
    handle.revert()
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func is stock_func


def test_t5_position_bias_given_as_a_keyword_gets_its_gradient():
    """T5's first layer computes the relative position bias and passes it to the others as a
    keyword; reentrant checkpointing would drop its gradient from every later layer."""
    model, batch = more_model("t5-relu")
    _, grads, _ = _step(model, batch)
    names = [name for name, p in model.named_parameters() if p.grad is not None]
    hf_actq.apply(model, ActQConfig.from_recipe("checkpoint", bits=8))
    assert checkpointed_layers(model)
    _, packed, _ = _step(model, batch)
    by_name = dict(zip(names, zip(grads, packed, strict=True), strict=True))
    for name, (exact, compressed) in by_name.items():
        assert _cosine(exact, compressed) > 0.99, name
    assert any("relative_attention_bias" in name for name in by_name)


def test_lora_layers_train_when_the_hidden_states_need_no_gradient():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_llama(hidden_size=64, intermediate_size=128),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    ids = torch.randint(3, 100, (2, 16))
    reference = [p.grad for p in model.parameters()]
    assert all(g is None for g in reference)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    exact = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    hf_actq.apply(model, ActQConfig.from_recipe("checkpoint", bits=8))
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and _cosine(exact[name], p.grad) > 0.99, name


def test_trainer_turning_checkpointing_on_again_keeps_the_packed_function(tmp_path):
    callback = ActQCallback(ActQConfig.from_recipe("checkpoint"))
    trainer = Trainer(
        model=_bert(dropout=0.1),
        args=_args(tmp_path, **{checkpointing_argument(): True}),
        train_dataset=Toy(False),
        callbacks=[callback],
    )
    trainer.train()
    layers = checkpointed_layers(trainer.model)
    assert layers and all(_is_packed(layer) for layer in layers.values())
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


def test_a_model_without_checkpointed_layers_warns(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        handle = hf_actq.apply(model, ActQConfig.from_recipe("checkpoint"))
    assert "needs a transformers model whose layers support gradient checkpointing" in caplog.text
    assert handle.checkpointed == {} and handle.patched  # the generic path still compresses


def test_layers_with_dropout_are_named_as_compiling_with_breaks(caplog):
    # Under torch.compile such layers run the eager node (tests/ops/test_packed_checkpoint.py):
    # the user is told which, once, when the model is patched.
    for dropout, told in ((0.1, True), (0.0, False)):
        model = _bert(dropout)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_actq"):
            hf_actq.apply(model, ActQConfig.from_recipe("checkpoint"))
        assert ("checkpointed layers use dropout" in caplog.text) is told


def test_config_checks():
    with pytest.raises(ValueError, match="checkpoint_bits must be None or an integer in 1..8"):
        ActQConfig(checkpoint_bits=9)
    with pytest.raises(ValueError, match="checkpoint_codec must be 'uniform' or 'rotated'"):
        ActQConfig(checkpoint_bits=4, checkpoint_codec="aq")
    with pytest.raises(ValueError, match="cannot be combined with adaptive=True"):
        ActQConfig(codec="aq", bits=1, adaptive=True, checkpoint_bits=4)
    config = ActQConfig.from_recipe("checkpoint", bits=3)
    assert (config.checkpoint_bits, config.bits, config.compress_checkpointed) == (3, 8, False)
    assert ActQConfig.from_dict(config.to_dict()) == config


def test_bf16_autocast_recompute_runs_under_the_forward_autocast():
    """The recompute runs in backward, outside the caller's autocast: it must restore the
    forward's, or the layer would recompute in fp32."""
    model = tiny_model("llama")
    batch = _longer_batch("llama")

    def step():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, exact = step()
    hf_actq.apply(model, ActQConfig.from_recipe("checkpoint", bits=8))
    dtypes = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: dtypes.append(out.dtype)
    )
    packed_loss, grads = step()
    hook.remove()
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the first pass and the recompute
    assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-2)
    for a, b in zip(exact, grads, strict=True):
        assert _cosine(a, b) > 0.98


def test_rotated_layer_inputs_keep_the_bytes_and_round_finer():
    """``checkpoint_codec="rotated"``: each layer's input keeps uniform rounding's bytes and,
    where a few features are large (as a pretrained model's are), its gradients come closer to
    exact than unrotated rounding's."""
    model = tiny_model("llama")
    with torch.no_grad():  # outlier features in every layer's input, from the embedding on
        model.model.embed_tokens.weight[:, :3] *= 25
    batch = _longer_batch("llama")
    loss, exact, _ = _step(model, batch)
    errors, nbytes = {}, {}
    for codec in ("uniform", "rotated"):
        config = ActQConfig.from_recipe("checkpoint", bits=4, checkpoint_codec=codec)
        handle = hf_actq.apply(model, config)
        layers = checkpointed_layers(model)
        assert all(
            layer._gradient_checkpointing_func.keywords["codec"].name
            == ("rotated" if codec == "rotated" else "aq")
            for layer in layers.values()
        )
        errors[codec], nbytes[codec] = 0.0, None
        for seed in range(4):
            torch.manual_seed(seed)
            packed_loss, grads, nbytes[codec] = _step(model, batch)
            assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-6, abs=0)
            errors[codec] += sum(float((g - e).pow(2).sum()) for g, e in zip(grads, exact))
        handle.revert()
    assert nbytes["rotated"] == nbytes["uniform"]
    assert errors["rotated"] < errors["uniform"] / 2
