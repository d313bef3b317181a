"""The fused linear + cross-entropy bound onto encoder-decoder LMs (T5 with tied and untied
embeddings, BART with its final logits bias): the stock loss and gradients, no [tokens, vocab]
tensor kept, logits where asked for, and the stock forward back after revert."""

import pytest
import torch
from test_causal_lm import LOSS_ONLY, _loss_and_grads

import hf_actq
from hf_actq import ActQConfig
from hf_actq.testing import MORE_MODELS, more_model


def _untied_t5():
    model, batch = MORE_MODELS["t5"]()
    # Flan-T5 / T5 v1.1: a head of its own and no scaling of the decoder's output.
    config = model.config
    config.tie_word_embeddings, config.scale_decoder_outputs = False, False
    return type(model)(config), batch


def _model(name):
    if name == "t5-untied":
        torch.manual_seed(0)
        model, batch = _untied_t5()
        return model.train(), batch
    model, batch = more_model(name)
    if name == "bart":  # a final logits bias that is not zero, as in pretrained BART
        model.final_logits_bias.normal_()
    return model, batch


@pytest.mark.parametrize("name", ["t5", "t5-relu", "t5-untied", "bart"])
def test_fused_loss_matches_the_stock_loss_and_keeps_no_vocab_sized_tensor(name):
    model, batch = _model(name)
    if name == "t5-untied":
        assert model.lm_head.weight is not model.shared.weight
    batch["labels"][0, -3:] = -100  # padded targets
    stock, stock_grads, stock_meter = _loss_and_grads(model, batch)
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    assert handle.patched[""].startswith("seq2seq lm_loss")
    fused, grads, meter = _loss_and_grads(model, batch)
    assert fused.logits is None and fused[0] is fused.loss
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    # Relative to each tensor's scale, except for gradients that are zero in exact arithmetic
    # (BART's key biases: softmax ignores a constant shift), which only rounding fills.
    scale = max(g.abs().max() for g in stock_grads)
    for got, want in zip(grads, stock_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
    tokens, vocab = batch["labels"].numel(), model.config.vocab_size
    assert stock_meter.by_kind().get("lm_loss", 0) >= tokens * vocab * 4
    head = model.get_output_embeddings().weight
    assert meter.by_kind().get("lm_loss", 0) <= tokens * head.shape[1] * 4 + head.numel() * 4
    assert meter.nbytes < stock_meter.nbytes
    # A tuple when asked for one, loss first.
    as_tuple = model(**batch, return_dict=False)
    torch.testing.assert_close(as_tuple[0], stock.loss, rtol=1e-6, atol=1e-6)
    # Logits where the caller needs them: eval, no_grad, no labels, or return_logits=True.
    expected_shape = (*batch["labels"].shape, vocab)
    assert model(**batch, return_logits=True).logits.shape == expected_shape
    with torch.no_grad():
        assert model(**batch).logits.shape == expected_shape
    handle.revert()
    reverted, reverted_grads, _ = _loss_and_grads(model, batch)
    assert torch.equal(reverted.loss, stock.loss) and reverted.logits is not None
    for got, want in zip(reverted_grads, stock_grads):
        assert torch.equal(got, want)


def test_explicit_decoder_inputs_and_the_switch():
    model, batch = _model("t5")
    decoder_input_ids = torch.randint(3, 100, batch["labels"].shape)
    expected = model(**batch, decoder_input_ids=decoder_input_ids).loss
    handle = hf_actq.apply(model, ActQConfig(fused_loss=False, **LOSS_ONLY))
    assert "" not in handle.patched
    handle.revert()
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    out = model(**batch, decoder_input_ids=decoder_input_ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)
    model.config.return_dict = False  # a tuple, as the stock forward gives then
    as_tuple = model(**batch, decoder_input_ids=decoder_input_ids)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], expected, rtol=1e-6, atol=1e-6)
    handle.revert()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_the_fewbit_recipe_returns_the_stock_outputs_with_labels(name):
    # "fewbit" promises that nothing but the activation derivatives changes: no fused loss,
    # logits as the stock model gives them, in train and eval mode.
    model, batch = _model(name)
    for training in (True, False):
        model.train(training)
        torch.manual_seed(0)
        stock = model(**batch)
        handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit"))
        torch.manual_seed(0)
        patched = model(**batch)
        handle.revert()
        assert "" not in handle.patched
        assert torch.equal(patched.logits, stock.logits) and torch.equal(patched.loss, stock.loss)
