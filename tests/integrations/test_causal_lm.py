"""The fused linear + cross-entropy bound onto every registered causal LM: the same loss and
gradients as the stock head and loss, no [tokens, vocab] tensor kept, logits where asked for,
and the stock forward back after revert."""

import copy

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.testing import ENCODERS, TINY_SIZES, tiny_model

DECODERS = sorted(set(TINY_SIZES) - set(ENCODERS))
# Everything off but the fused loss: its own effect, compared with the stock model.
LOSS_ONLY = dict(
    activations=False, linear=False, norm=False, gated_mlp=False, attention=False, dropout=False
)


def _loss_and_grads(model, batch, **kwargs):
    model.zero_grad()
    params = [p for p in model.parameters() if p.requires_grad]
    with SavedTensorMeter(exclude=params, model=model) as meter:
        out = model(**batch, **kwargs)
    out.loss.backward()
    # Unused parameters (an untied model's second embedding copy) have no gradient: zeros.
    return out, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params], meter


@pytest.mark.parametrize("model_type", DECODERS)
def test_fused_loss_matches_the_stock_loss_and_keeps_no_vocab_sized_tensor(model_type):
    overrides = {"final_logit_softcapping": 5.0} if model_type == "gemma2" else {}
    model = tiny_model(model_type)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (2, 12))
    labels = ids.clone()
    labels[:, :4] = -100  # a masked prompt
    batch = dict(input_ids=ids, labels=labels)
    stock, stock_grads, stock_meter = _loss_and_grads(model, batch, num_items_in_batch=17)
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    assert handle.patched[""].startswith("lm_loss")
    fused, grads, meter = _loss_and_grads(model, batch, num_items_in_batch=17)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, stock_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # The stock loss keeps fp32 log-probabilities over the vocabulary; the fused one the
    # [tokens, hidden] gradient (plus the tied or trained head's weight gradient).
    vocab_bytes = ids.numel() * model.config.vocab_size * 4
    assert stock_meter.by_kind().get("lm_loss", 0) >= vocab_bytes
    head = model.get_output_embeddings().weight
    assert meter.by_kind().get("lm_loss", 0) <= ids.numel() * head.shape[1] * 4 + head.numel() * 4
    assert meter.nbytes < stock_meter.nbytes
    # Logits where the caller needs them: eval, no_grad, or return_logits=True.
    assert model(**batch, return_logits=True).logits.shape == (2, 12, model.config.vocab_size)
    with torch.no_grad():
        assert model(**batch).logits is not None
    model.eval()
    assert model(**batch).logits is not None
    model.train()
    handle.revert()
    reverted, reverted_grads, _ = _loss_and_grads(model, batch, num_items_in_batch=17)
    assert torch.equal(reverted.loss, stock.loss) and reverted.logits is not None
    for got, want in zip(reverted_grads, stock_grads):
        assert torch.equal(got, want)


def test_fused_loss_switch_and_positional_input_ids():
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 12))
    expected = model(ids, labels=ids).loss
    handle = hf_actq.apply(model, ActQConfig(fused_loss=False))
    assert "" not in handle.patched and model(ids, labels=ids).logits is not None
    handle.revert()
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    out = model(ids, labels=ids)  # input_ids given positionally, as many loops do
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)
    assert model(ids, labels=ids, return_dict=False)[0].shape == ()
    model.config.return_dict = False  # a tuple, as the stock forward gives then
    assert isinstance(model(ids, labels=ids), tuple)
    handle.revert()


def test_lora_model_with_a_frozen_head_trains_with_the_fused_loss():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 12))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    stock, stock_grads, _ = _loss_and_grads(model, dict(input_ids=ids, labels=ids))
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    fused, grads, _ = _loss_and_grads(model, dict(input_ids=ids, labels=ids))
    assert fused.logits is None and handle.patched[""].startswith("lm_loss")
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, stock_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    handle.revert()


def test_the_vocabulary_sized_tensor_is_gone_from_the_step_peak():
    from hf_actq.memory import PeakMemory

    model = tiny_model("llama", vocab_size=4096)
    ids = torch.randint(3, 4096, (4, 64))
    logits_bytes = ids.numel() * 4096 * 4  # one fp32 [tokens, vocab] tensor

    def largest(model):
        with PeakMemory() as peak:
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad()
        return peak.largest_bytes

    assert largest(model) >= logits_bytes
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    # Its largest allocation is now a chunk of logits or a weight-sized gradient.
    assert largest(model) < logits_bytes / 4
    handle.revert()


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2"])
def test_the_fewbit_recipe_returns_the_stock_outputs_with_labels(model_type):
    # "fewbit" promises that nothing but the activation derivatives changes: no fused loss,
    # logits as the stock model gives them, in train and eval mode; the fused loss only when
    # asked for.
    model = tiny_model(model_type)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids)
    for training in (True, False):
        model.train(training)
        stock = model(**batch)
        handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit"))
        patched = model(**batch)
        handle.revert()
        assert "" not in handle.patched
        assert torch.equal(patched.logits, stock.logits) and torch.equal(patched.loss, stock.loss)
    model.train()
    handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit", fused_loss=True))
    assert model(**batch).logits is None
    handle.revert()


def _fp16_lora_llama():
    from peft import LoraConfig, get_peft_model

    from hf_actq.testing import tiny_llama

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(tiny_llama(vocab_size=32000), lora)  # adapters stay fp32
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: no signal
            torch.nn.init.normal_(parameter, std=0.1)
    return model


@pytest.mark.parametrize("recipe", ["fewbit", "uniform", "alam", "checkpoint", "loss-only"])
def test_fp16_lora_under_a_grad_scaler_gets_stock_quality_lora_gradients(recipe):
    # An fp16 base with fp32 LoRA adapters and a frozen head, under torch's GradScaler at its
    # default 65536: the fused loss used to make every gradient inf (the step skipped) and, at
    # 32768, give the LoRA weights 4x the stock error.
    reference = _fp16_lora_llama().train()
    fp16 = copy.deepcopy(reference).half()
    for parameter in fp16.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    torch.manual_seed(1)
    ids = torch.randint(3, 32000, (4, 128))

    def lora_grads(model, scaler=None):
        model.zero_grad()
        torch.manual_seed(2)
        loss = model(input_ids=ids, labels=ids).loss
        (loss if scaler is None else scaler.scale(loss)).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        if scaler is not None:
            optimizer = torch.optim.SGD(params, lr=0.0)
            scaler.unscale_(optimizer)
            assert not sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
        return [p.grad.clone() for p in params]

    exact = lora_grads(reference)
    stock = lora_grads(fp16, torch.amp.GradScaler("cpu"))
    config = ActQConfig(**LOSS_ONLY) if recipe == "loss-only" else ActQConfig.from_recipe(recipe)
    handle = hf_actq.apply(fp16, config)
    patched = lora_grads(fp16, torch.amp.GradScaler("cpu"))  # finite, or the assert above fails
    handle.revert()
    if recipe == "loss-only":  # the loss's own effect: no worse than 2x stock's fp16 error
        for want, got_stock, got in zip(exact, stock, patched, strict=True):
            stock_error = (got_stock - want).norm() / want.norm()
            assert (got - want).norm() / want.norm() <= 2 * stock_error


def test_an_ignore_index_passed_to_the_forward_is_the_fused_losss_too():
    # The stock forward hands ignore_index to its loss; the fused loss used to keep -100.
    from hf_actq.testing import tiny_llama

    model = tiny_llama().train()
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (2, 12))
    labels = ids.clone()
    labels[:, :4] = 7  # a prompt marked with the caller's own index
    batch = dict(input_ids=ids, labels=labels, ignore_index=7)
    stock, stock_grads, _ = _loss_and_grads(model, batch)
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    fused, grads, _ = _loss_and_grads(model, batch)
    handle.revert()
    assert fused.logits is None  # the fused path ran
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, stock_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("recipe", ["fewbit", "uniform", "alam", "checkpoint"])
def test_a_gradient_penalty_through_a_patched_model_raises_instead_of_dropping(recipe):
    # create_graph=True: the fused loss's backward returned constants (torch's
    # once_differentiable does when the incoming gradient needs none), so a gradient penalty
    # added to the loss lost every op's part without a word.
    from hf_actq.testing import tiny_llama

    model = tiny_llama().train()
    hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    ids = torch.randint(3, 100, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    penalty = sum(g.square().sum() for g in grads if g is not None)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (loss + penalty).backward()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("asked", ["config", "call"])
def test_a_mixture_of_experts_keeps_its_router_loss_under_the_fused_loss(model_type, asked):
    """With router logits asked for, the stock forward adds the load-balancing loss: so does
    the fused one, and returns it as ``aux_loss``; the router's gradient is the stock one."""
    from hf_actq.testing import MORE_MODELS, more_model, tiny_batch, tiny_model

    if model_type in MORE_MODELS:
        model, batch = more_model(model_type)
    else:
        model, batch = tiny_model(model_type), tiny_batch(model_type)
    model.train()
    kwargs = {"output_router_logits": True} if asked == "call" else {}
    model.config.output_router_logits = asked == "config"
    stock, stock_grads, _ = _loss_and_grads(model, batch, **kwargs)
    assert stock.aux_loss is not None
    handle = hf_actq.apply(model, ActQConfig(**LOSS_ONLY))
    fused, grads, _ = _loss_and_grads(model, batch, **kwargs)
    handle.revert()
    assert fused.logits is None
    torch.testing.assert_close(fused.aux_loss, stock.aux_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    routers = [
        i for i, (name, _) in enumerate(p for p in model.named_parameters() if p[1].requires_grad)
        if name.endswith(("gate.weight", "router.weight"))
    ]  # fmt: skip
    assert routers
    for got, want in zip(grads, stock_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
