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


def test_t5_wo_rebuilds_its_input_from_the_gated_product_and_the_dropout_seed(monkeypatch):
    """T5 feeds wo the dropout of its gated product: wo takes the product rebuilt from the
    operands the product op keeps, through the dropout's seed, instead of packing the
    intermediate-size tensor again. Fewer bytes, gradients as with its own pack."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from hf_actq import SavedTensorMeter
    from hf_actq.ops import dedup, gated_mlp

    config = AutoConfig.for_model(
        "t5", vocab_size=100, d_model=32, d_kv=8, d_ff=96, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", dropout_rate=0.1, decoder_start_token_id=0,
    )  # fmt: skip
    source = torch.randint(3, 100, (2, 14), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=source, labels=source[:, :9])

    def step(offer: bool):
        torch.manual_seed(0)
        model = AutoModelForSeq2SeqLM.from_config(config).train()
        hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
        packed = []
        original = dedup.PackCache._packed

        def logged(watcher, slot, x, codec, seed):
            packed.append(slot)
            return original(watcher, slot, x, codec, seed)

        with monkeypatch.context() as patch:
            patch.setattr(dedup.PackCache, "_packed", staticmethod(logged))
            if not offer:
                patch.setattr(gated_mlp, "may_offer", lambda state: False)
            torch.manual_seed(1)
            with SavedTensorMeter(exclude=list(model.parameters())) as meter:
                loss = model(**batch).loss
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return [s for s in packed if s and s.endswith(".wo:input")], meter.nbytes, grads

    step(offer=False)  # a process's first patched step draws from torch's RNG in its setup
    offered_wo, offered_bytes, offered = step(offer=True)
    packed_wo, packed_bytes, packed = step(offer=False)
    assert offered_wo == [] and len(packed_wo) == 4  # 2 encoder and 2 decoder layers
    # Each wo's [tokens, 96] input at 4 bits, codes and metadata, is gone.
    tokens = 2 * 14 * 2 + 2 * 9 * 2
    assert packed_bytes - offered_bytes >= tokens * 96 // 2, (packed_bytes, offered_bytes)
    assert torch.nn.functional.cosine_similarity(offered, packed, dim=0) > 0.97
