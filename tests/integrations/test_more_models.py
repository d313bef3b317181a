"""Model types beyond dense text encoders and decoders: mixture-of-experts decoders (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE), DeBERTa-v3 (disentangled attention), ViT, CLIP (both towers),
BART and T5 (self- and cross-attention,
source and target of different lengths; T5 v1.1's gated-GELU feed-forward and relative position
bias, and T5 v1.0's ReLU), built from tiny configs. Their attention goes
through transformers' ``AttentionInterface``, so the registry lists them as data
(``MODEL_LAYOUTS``)."""

import functools

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    CLIPConfig,
    CLIPModel,
)

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.integrations.transformers import MODEL_TYPE_TO_APPLY_FN

TOWER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _vit():
    config = AutoConfig.for_model(
        "vit",
        image_size=32,
        patch_size=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **TOWER,
    )
    batch = dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 2]))
    return AutoModelForImageClassification.from_config(config), batch


def _clip():
    config = CLIPConfig(
        text_config=dict(vocab_size=100, bos_token_id=1, eos_token_id=2, **TOWER),
        vision_config=dict(image_size=32, patch_size=8, **TOWER),
        projection_dim=16,
    )
    batch = dict(
        input_ids=torch.randint(3, 100, (3, 10)),
        pixel_values=torch.randn(3, 3, 32, 32),
        return_loss=True,
    )
    return CLIPModel(config), batch


def _bart():
    config = AutoConfig.for_model(
        "bart",
        vocab_size=100,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    source = torch.randint(3, 100, (2, 14))
    mask = torch.ones_like(source)
    mask[1, 10:] = 0  # a padded source: the cross-attention mask matters
    batch = dict(input_ids=source, attention_mask=mask, labels=torch.randint(3, 100, (2, 9)))
    return AutoModelForSeq2SeqLM.from_config(config), batch


def _t5(feed_forward_proj):
    config = AutoConfig.for_model(
        "t5",
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        feed_forward_proj=feed_forward_proj,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    source = torch.randint(3, 100, (2, 14))
    mask = torch.ones_like(source)
    mask[1, 10:] = 0
    batch = dict(input_ids=source, attention_mask=mask, labels=torch.randint(3, 100, (2, 9)))
    return AutoModelForSeq2SeqLM.from_config(config), batch


def _moe(model_type):
    # Four experts, two per token; Qwen2-MoE adds a shared expert (a dense gated MLP).
    config = AutoConfig.for_model(
        model_type,
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    ids = torch.randint(3, 100, (2, 12))
    return AutoModelForCausalLM.from_config(config), dict(input_ids=ids, labels=ids)


def _deberta(dropout=0.0):
    # DeBERTa-v3's attention: relative positions in buckets, both disentangled terms, the
    # position projections shared with the content keys and queries.
    config = AutoConfig.for_model(
        "deberta-v2",
        vocab_size=100,
        num_labels=3,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **TOWER,
    )
    ids = torch.randint(3, 100, (2, 14))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2]))
    return AutoModelForSequenceClassification.from_config(config), batch


# Vision-language models: a 32x32 image in 8x8 patches, its tokens at positions 2.. of a
# 128-token vocabulary (image token 120), the loss on the text tokens.
_LANGUAGE = dict(TOWER, num_key_value_heads=2, head_dim=8, vocab_size=128)
_VISION = dict(TOWER, image_size=32, patch_size=8)


def _image_batch(image_tokens: int, token_types: bool) -> dict:
    ids = torch.randint(3, 100, (2, 10 + image_tokens))
    ids[:, 2 : 2 + image_tokens] = 120
    labels = torch.where(ids == 120, -100, ids)
    batch = dict(input_ids=ids, pixel_values=torch.randn(2, 3, 32, 32), labels=labels)
    if token_types:  # Gemma 3: image tokens attend to each other both ways
        batch["token_type_ids"] = (ids == 120).long()
    return batch


def _gemma3():
    # SigLIP vision tower, its patches pooled to 4 tokens, a sliding-window Gemma 3 decoder.
    config = AutoConfig.for_model(
        "gemma3",
        text_config=dict(_LANGUAGE, sliding_window=4),
        vision_config=_VISION,
        mm_tokens_per_image=4,
        image_token_id=120,
        boi_token_id=121,
        eoi_token_id=122,
    )
    model = AutoModelForImageTextToText.from_config(config)
    # transformers initialises the projection at zero; a trained one is not (at zero, every
    # image token reaches the decoder's RMSNorm as 0, whose derivative there is 1/sqrt(eps)).
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    return model, _image_batch(4, token_types=True)


def _llava():
    # A CLIP vision tower (its 16 patch features, CLS dropped) into a LLaMA decoder.
    config = AutoConfig.for_model(
        "llava",
        text_config=dict(_LANGUAGE, model_type="llama"),
        vision_config=dict(_VISION, model_type="clip_vision_model"),
        image_token_id=120,
    )
    return AutoModelForImageTextToText.from_config(config), _image_batch(16, token_types=False)


def _qwen_vl(model_type, vision):
    # Qwen2-VL / Qwen2.5-VL: two 16x16 images in 4x4 patches (the vision attention runs one
    # image at a time), 2x2 patches merged into each of an image's 4 tokens, M-RoPE.
    text = dict(_LANGUAGE, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]})
    text.pop("head_dim")
    vision = dict(vision, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, image_token_id=120,
        video_token_id=121, vision_start_token_id=122,
    )  # fmt: skip
    batch = _image_batch(4, token_types=False)
    batch["pixel_values"] = torch.randn(2 * 16, 3 * 2 * 4 * 4)
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 4, 4]])
    batch["mm_token_type_ids"] = (batch["input_ids"] == 120).long()
    return AutoModelForImageTextToText.from_config(config), batch


MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

BUILDERS = {
    "deberta-v2": _deberta,
    **{name: functools.partial(_moe, name) for name in MOE},
    "vit": _vit,
    "clip": _clip,
    "bart": _bart,
    "t5": lambda: _t5("gated-gelu"),
    "t5-relu": lambda: _t5("relu"),
    "gemma3": _gemma3,
    "llava": _llava,
    "qwen2_vl": lambda: _qwen_vl(
        "qwen2_vl", dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2)
    ),
    "qwen2_5_vl": lambda: _qwen_vl(
        "qwen2_5_vl",
        dict(
            depth=2,
            hidden_size=32,
            out_hidden_size=32,
            num_heads=4,
            intermediate_size=64,
            window_size=8,
            fullatt_block_indexes=[1],
        ),
    ),  # fmt: skip
}


def _build(name):
    torch.manual_seed(0)
    model, batch = BUILDERS[name]()
    return model.train(), batch


def _step(model, batch):
    model.zero_grad()
    params = list(model.parameters())
    with SavedTensorMeter(exclude=params) as meter:
        out = model(**batch)
    out.loss.backward()
    grads = [p.grad.clone() for p in params if p.grad is not None]
    return out.loss.detach(), grads, meter.nbytes


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_registered_with_attention_compressed(name):
    model, batch = _build(name)
    assert model.config.model_type in MODEL_TYPE_TO_APPLY_FN
    nbytes = {}
    for attention in (False, True):
        config = ActQConfig.from_recipe("uniform", bits=4, attention=attention)
        handle = hf_actq.apply(model, config)
        nbytes[attention] = _step(model, batch)[2]
        kinds = set(handle.slots.values())
        assert {"linear", "norm", "activation"} <= kinds
        assert ("attention" in kinds) == attention and "attention" not in handle.skipped
        handle.revert()
    # The attention slots are filled: the model's attention runs through the compressed op.
    assert nbytes[True] < 0.9 * nbytes[False]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fewbit_keeps_the_loss_bit_identical_with_fewer_bytes_and_reverts(name):
    model, batch = _build(name)
    loss, grads, nbytes = _step(model, batch)
    # Without the decoders' fused linear + cross-entropy, whose chunked sums some CPUs round
    # 1 ulp differently (its own tests bound it).
    handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit", fused_loss=False))
    patched_loss, _, patched_bytes = _step(model, batch)
    assert torch.equal(patched_loss, loss)
    assert patched_bytes < nbytes
    handle.revert()
    reverted_loss, reverted_grads, reverted_bytes = _step(model, batch)
    assert torch.equal(reverted_loss, loss) and reverted_bytes == nbytes
    assert all(torch.equal(a, b) for a, b in zip(reverted_grads, grads))


@pytest.mark.parametrize("name", ["gemma3", "llava", "qwen2_vl", "qwen2_5_vl"])
def test_vision_language_heads_take_the_fused_loss(name):
    model, batch = _build(name)
    stock = model(**batch)
    stock.loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]  # unused ones have none
    stock_grads = [p.grad.clone() for p in params]
    model.zero_grad()
    # The loss alone: its own effect against the stock head.
    off = dict(activations=False, linear=False, norm=False, gated_mlp=False, attention=False)
    handle = hf_actq.apply(model, ActQConfig(**off, dropout=False))
    assert handle.patched[""].startswith("lm_loss")
    with SavedTensorMeter(exclude=params, model=model) as meter:
        fused = model(**batch)
    fused.loss.backward()
    assert fused.logits is None and type(fused) is type(stock)
    for field in stock.keys() - {"loss", "logits"}:  # the image outputs, the cache
        assert (getattr(fused, field) is None) == (getattr(stock, field) is None), field
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    for p, want in zip(params, stock_grads):
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)
    tokens = batch["input_ids"].numel()
    assert meter.by_kind().get("lm_loss", 0) < tokens * model.config.text_config.vocab_size * 4
    # A loss of the user's own: the stock head and that loss run.
    model.loss_function = lambda logits, labels, **kwargs: logits.float().square().mean()
    custom = model(**batch)
    assert custom.logits is not None
    torch.testing.assert_close(custom.loss, stock.logits.float().square().mean())
    handle.revert()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_uniform_8_bits_keeps_every_gradient_close_with_fewer_bytes(name):
    model, batch = _build(name)
    _, grads, nbytes = _step(model, batch)
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    torch.manual_seed(0)
    _, patched, patched_bytes = _step(model, batch)
    assert patched_bytes < nbytes / 2
    scale = max(g.norm() for g in grads)
    for exact, got in zip(grads, patched):
        if exact.norm() > 1e-4 * scale:  # not the (zero) key-bias gradients
            cosine = torch.nn.functional.cosine_similarity(exact.flatten(), got.flatten(), dim=0)
            assert cosine > 0.98


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [("fewbit", {}), ("uniform", {"bits": 4}), ("alam", {"bits": 1, "adaptive": False})],
)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_no_recipe_keeps_more_bytes_than_the_unpatched_model(name, recipe, overrides):
    model, batch = _build(name)
    nbytes = _step(model, batch)[2]
    handle = hf_actq.apply(model, ActQConfig.from_recipe(recipe, **overrides))
    assert _step(model, batch)[2] <= nbytes, handle.patched


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_training_under_uniform_4_bits_tracks_the_unpatched_loss(name):
    losses = {}
    for patched in (False, True):
        model, batch = _build(name)
        if patched:
            hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        torch.manual_seed(1)
        history = []
        for _ in range(12):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        losses[patched] = history
    exact, compressed = losses[False], losses[True]
    assert exact[-1] < 0.8 * exact[0]  # the run learns (memorises the batch)
    drop = exact[0] - exact[-1]
    assert abs(compressed[-1] - exact[-1]) < 0.1 * drop, (exact, compressed)


def test_t5_patches_every_stack_and_its_gated_mlp_and_reverts_each_config():
    # T5 gives its encoder and decoder copies of the model config; both must run the compressed
    # attention, and both must get their own implementation back.
    model, batch = _build("t5")
    stacks = (model.encoder.config, model.decoder.config)
    assert len({id(model.config), *map(id, stacks)}) == 3
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    assert all(c._attn_implementation == "hf_actq_sdpa" for c in (model.config, *stacks))
    ff = model.encoder.block[0].layer[1]
    assert handle.patched["encoder.block.0.layer.1.DenseReluDense"].startswith("gated_mlp")
    assert handle.patched["encoder.block.0.layer.1.layer_norm"].startswith("norm")
    assert "encoder.block.0.layer.1.DenseReluDense.act" not in handle.patched  # the MLP's own
    assert type(ff.layer_norm).__name__ == "T5LayerNorm"
    handle.revert()
    assert all(c._attn_implementation == "sdpa" for c in (model.config, *stacks))


def test_t5_set_to_eager_attention_keeps_it_exact_and_says_why():
    torch.manual_seed(0)
    model, _ = BUILDERS["t5"]()
    model.set_attn_implementation("eager")
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    assert "attention" not in set(handle.slots.values())
    assert "kept exact" in handle.skipped["attention"]


@pytest.mark.parametrize("name", MOE)
def test_moe_experts_run_the_compressed_op_and_revert(name):
    model, batch = _build(name)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(e.config._experts_implementation == "grouped_mm" for e in experts)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    assert all(e.config._experts_implementation == "hf_actq_experts" for e in experts)
    described = [d for p, d in handle.patched.items() if p.endswith(".mlp.experts")]
    assert len(described) == 2 and all(d.startswith("moe_experts") for d in described)
    assert {"layers.0.mlp.experts:act", "layers.0.mlp.experts:up"} <= {
        s.removeprefix("model.") for s in handle.slots
    }
    # The router stays exact: nothing of it is patched.
    assert not any(".mlp.gate" in p and "proj" not in p for p in handle.patched)
    handle.revert()
    assert all(e.config._experts_implementation == "grouped_mm" for e in experts)


def test_lora_on_the_expert_weights_trains_through_the_compressed_experts():
    # PEFT's target_parameters wraps the experts' 3-D weights (base + low-rank delta): the op
    # takes the effective weights as inputs, so the adapters get their gradients through it.
    import peft

    model, batch = _build("mixtral")
    lora = peft.LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(model, lora).train()
    _, grads, nbytes = _step(model, batch)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    assert sum(p.endswith("mlp.experts.base_layer.base_layer") for p in handle.patched) == 2
    # The wrappers' lora_A / lora_B modules are never called: no slots for them.
    wrapped = [p for p in handle.skipped if "experts" in p and ".lora_" in p]
    assert len(wrapped) == 8 and not any("experts" in s and ".lora_" in s for s in handle.slots)
    _, patched, patched_bytes = _step(model, batch)
    assert patched_bytes < 0.75 * nbytes
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    assert sum("experts" in n for n in names) == 8  # A and B of two wrapped weights, two layers
    for name, exact, got in zip(names, grads, patched):
        cosine = torch.nn.functional.cosine_similarity(exact.flatten(), got.flatten(), dim=0)
        assert cosine > 0.99, name


def test_deberta_attention_with_exact_operands_and_dropout_gives_the_stock_gradients():
    # q, k, v kept exact: the op's backward differentiates the same core again with the
    # forward's dropout draws, so gradients are those of the same model with attention left to
    # its own code (dropout patched alike in both runs).
    results = []
    for attention in (False, True):
        torch.manual_seed(0)
        model, batch = _deberta(dropout=0.2)
        model.train()
        config = ActQConfig.from_recipe("uniform", bits=8, attention=attention)
        handle = hf_actq.apply(model, config)
        for path in [p for p, kind in handle.slots.items() if kind == "attention"]:
            state, slot = handle._states[path]
            state.codecs[slot] = None
        torch.manual_seed(1)
        loss, grads, _ = _step(model, batch)
        results.append((loss, grads))
    (loss, grads), (ours, our_grads) = results
    assert torch.equal(ours, loss)
    for a, b in zip(our_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["t5", "mixtral", "deberta-v2"])
def test_gradient_checkpointing_gives_the_same_step(name):
    # Checkpointing recomputes each layer's forward, so the new ops run twice per step: the
    # loss and gradients match the step without it (the same rounding draws are replayed).
    results = []
    for checkpointing in (False, True):
        model, batch = _build(name)
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
        torch.manual_seed(0)
        results.append(_step(model, batch)[:2])
    (loss, grads), (checkpointed, checkpointed_grads) = results
    assert checkpointed == loss and len(checkpointed_grads) == len(grads)
    for a, b in zip(grads, checkpointed_grads):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("name", ["t5", "mixtral", "deberta-v2"])
def test_bf16_autocast_step_follows_the_unpatched_one(name):
    # The recomputing ops (DeBERTa's attention) replay the forward's autocast in backward.
    results = []
    for patched in (False, True):
        model, batch = _build(name)
        if patched:
            hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        results.append([p.grad for p in model.parameters() if p.grad is not None])
    exact, patched = results
    assert len(exact) == len(patched)
    for a, b in zip(exact, patched):
        if a.norm() > 0:
            assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98
