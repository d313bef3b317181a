"""Model types beyond dense text encoders and decoders: mixture-of-experts decoders (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE), DeBERTa-v3 (disentangled attention), ViT, CLIP (both towers),
BART and T5 (self- and cross-attention,
source and target of different lengths; T5 v1.1's gated-GELU feed-forward and relative position
bias, and T5 v1.0's ReLU), built from tiny configs. Their attention goes
through transformers' ``AttentionInterface``, so the registry lists them as data
(``MODEL_LAYOUTS``)."""

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.integrations.transformers import MODEL_TYPE_TO_APPLY_FN
from hf_actq.testing import MOE, MORE_MODELS, more_model, tiny_batch, tiny_model

VISION_LANGUAGE = ["gemma3", "gemma4", "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe"]


def _step(model, batch):
    model.zero_grad()
    params = list(model.parameters())
    with SavedTensorMeter(exclude=params) as meter:
        out = model(**batch)
    out.loss.backward()
    grads = [p.grad.clone() for p in params if p.grad is not None]
    return out.loss.detach(), grads, meter.nbytes


@pytest.mark.parametrize("name", sorted(MORE_MODELS))
def test_registered_with_attention_compressed(name):
    model, batch = more_model(name)
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


@pytest.mark.parametrize("name", sorted(MORE_MODELS))
def test_fewbit_keeps_the_loss_bit_identical_with_fewer_bytes_and_reverts(name):
    model, batch = more_model(name)
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


@pytest.mark.parametrize("name", VISION_LANGUAGE)
def test_vision_language_heads_take_the_fused_loss(name):
    model, batch = more_model(name)
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
    model.loss_function = lambda logits, labels, *args, **kwargs: logits.float().square().mean()
    custom = model(**batch)
    assert custom.logits is not None
    torch.testing.assert_close(custom.loss, stock.logits.float().square().mean())
    handle.revert()


@pytest.mark.parametrize("name", sorted(MORE_MODELS))
def test_uniform_8_bits_keeps_every_gradient_close_with_fewer_bytes(name):
    model, batch = more_model(name)
    _, grads, nbytes = _step(model, batch)
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    torch.manual_seed(0)
    _, patched, patched_bytes = _step(model, batch)
    assert patched_bytes < nbytes / 2
    scale = max(g.norm() for g in grads)
    # Gemma 4's vision tower: the gradient of its first layer's pre-feedforward norm weight is
    # the least close, 0.978-0.992 over seeds 0-4 (0.979-0.987 with its v_norm kept exact).
    floor = 0.97 if name == "gemma4" else 0.98
    for exact, got in zip(grads, patched):
        if exact.norm() > 1e-4 * scale:  # not the (zero) key-bias gradients
            cosine = torch.nn.functional.cosine_similarity(exact.flatten(), got.flatten(), dim=0)
            assert cosine > floor


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [("fewbit", {}), ("uniform", {"bits": 4}), ("alam", {"bits": 1, "adaptive": False})],
)
@pytest.mark.parametrize("name", sorted(MORE_MODELS))
def test_no_recipe_keeps_more_bytes_than_the_unpatched_model(name, recipe, overrides):
    model, batch = more_model(name)
    nbytes = _step(model, batch)[2]
    handle = hf_actq.apply(model, ActQConfig.from_recipe(recipe, **overrides))
    assert _step(model, batch)[2] <= nbytes, handle.patched


# One model per kind in the default run (DeBERTa's attention, an MoE, an encoder-decoder, a vision
# encoder, a vision-language decoder); every model with -m slow.
TRAINED_BY_DEFAULT = {"deberta-v2", "mixtral", "bart", "vit", "qwen2_5_vl"}


@pytest.mark.parametrize(
    "name",
    [
        name if name in TRAINED_BY_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
        for name in sorted(MORE_MODELS)
    ],
)
def test_training_under_uniform_4_bits_tracks_the_unpatched_loss(name):
    losses = {}
    for patched in (False, True):
        model, batch = more_model(name)
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
    model, batch = more_model("t5")
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


def test_t5_set_to_eager_attention_runs_its_own_eager_function_recomputed():
    # T5's eager function adds the relative position bias, which the op differentiates as an
    # argument of the function (its embedding learns through it), recomputed from packed q, k, v.
    model, batch = more_model("t5")
    model.set_attn_implementation("eager")
    loss, grads, nbytes = _step(model, batch)
    bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    exact_bias_grad = bias.grad.clone()
    config = ActQConfig.from_recipe(
        "uniform",
        bits=8,
        linear=False,
        norm=False,
        gated_mlp=False,
        activations=False,
        fused_loss=False,
    )
    handle = hf_actq.apply(model, config)
    assert set(handle.slots.values()) == {"attention"}
    assert all("eager, recomputed" in d for p, d in handle.patched.items() if "Attention" in p)
    patched_loss, patched_grads, patched_bytes = _step(model, batch)
    handle.revert()
    assert torch.equal(patched_loss, loss)
    assert patched_bytes < nbytes
    assert len(patched_grads) == len(grads)
    for a, b in zip(patched_grads, grads):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
    assert (
        torch.nn.functional.cosine_similarity(bias.grad.flatten(), exact_bias_grad.flatten(), dim=0)
        > 0.999
    )


def test_gemma3_set_to_eager_recomputes_both_towers_and_leaves_torch_attention_alone():
    # Both towers' attention runs its own eager function, recomputed; SigLIP's pooling head is
    # torch's MultiheadAttention, which never calls the function the config names: left as is.
    model, batch = more_model("gemma3")
    model.set_attn_implementation("eager")
    loss, grads, nbytes = _step(model, batch)
    config = ActQConfig.from_recipe("uniform", bits=8, fused_loss=False)
    handle = hf_actq.apply(model, config)
    recomputed = [p for p, d in handle.patched.items() if "(eager, recomputed)" in d]
    assert any("vision_tower" in p for p in recomputed)
    assert any("language_model" in p for p in recomputed)
    assert "kept as it is" in handle.skipped["model.vision_tower.head.attention"]
    patched_loss, patched_grads, patched_bytes = _step(model, batch)
    handle.revert()
    assert torch.equal(patched_loss, loss) and patched_bytes < nbytes
    flat = [torch.cat([g.flatten() for g in gs]) for gs in (patched_grads, grads)]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.99


@pytest.mark.parametrize("name", MOE)
def test_moe_experts_run_the_compressed_op_and_revert(name):
    model, batch = more_model(name)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(e.config._experts_implementation == "grouped_mm" for e in experts)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    assert all(e.config._experts_implementation == "hf_actq_experts" for e in experts)
    described = [d for p, d in handle.patched.items() if p.endswith(".mlp.experts")]
    assert len(described) == 2 and all(d.startswith("moe_experts") for d in described)
    assert {"layers.0.mlp.experts:act", "layers.0.mlp.experts:up"} <= {
        s.removeprefix("model.") for s in handle.slots
    }
    # The router's linear keeps its input packed (shared with the experts); its softmax and
    # top-k run as they are.
    routers = [p for p in handle.patched if p.endswith(".mlp.gate")]
    assert len(routers) == 2 and all(handle.patched[p].startswith("MoE router") for p in routers)
    handle.revert()
    assert all(e.config._experts_implementation == "grouped_mm" for e in experts)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_experts_of_transformers_without_the_newer_flags_are_compressed_too():
    # Transformers 5.17 sets neither ``_is_expert_parallel`` nor ``has_post_expert_norm`` (it
    # has neither feature): its experts were skipped without a word until these counted as off.
    model, _ = more_model("mixtral")
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for module in experts:
        for flag in ("_is_expert_parallel", "has_post_expert_norm"):
            module.__dict__.pop(flag, None)
            assert not hasattr(module, flag)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    described = [d for p, d in handle.patched.items() if p.endswith(".mlp.experts")]
    assert len(described) == 2 and all(d.startswith("moe_experts") for d in described)
    # A flag that says a feature is on still keeps the experts as they are.
    handle.revert()
    experts[0]._is_expert_parallel = True
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    assert len([p for p in handle.patched if p.endswith(".mlp.experts")]) == 1
    assert "expert parallelism" in handle.skipped["model.layers.0.mlp.experts"]


def test_gpt_oss_experts_keep_their_projection_and_recompute_the_gate():
    # Transposed, biased, interleaved gate and up, a clamped GLU of its own: the op keeps the
    # packed projection and differentiates gpt-oss's own gate on it in backward.
    model = tiny_model("gpt_oss")
    batch = tiny_batch("gpt_oss")
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    loss, grads, nbytes = _step(model, dict(batch))
    config = ActQConfig.from_recipe("uniform", bits=8, fused_loss=False)
    without = hf_actq.apply(
        model,
        ActQConfig.from_recipe(
            "uniform", bits=8, gated_mlp=False, activations=False, fused_loss=False
        ),
    )
    assert not any(p.endswith(".mlp.experts") for p in without.patched)
    bytes_without = _step(model, dict(batch))[2]
    without.revert()
    handle = hf_actq.apply(model, config)
    described = [d for p, d in handle.patched.items() if p.endswith(".mlp.experts")]
    assert len(described) == 2 and all("gate recomputed" in d for d in described)
    assert {"model.layers.0.mlp.experts:gate_up", "model.layers.1.mlp.experts:gate_up"} <= set(
        handle.slots
    )
    assert all(e.config._experts_implementation == "hf_actq_experts" for e in experts)
    patched_loss, patched_grads, patched_bytes = _step(model, dict(batch))
    handle.revert()
    assert all(e.config._experts_implementation == "grouped_mm" for e in experts)
    assert torch.equal(patched_loss, loss)
    # Each routed row's gathered input, projection, the gate's intermediates, product and down
    # output: what the experts kept, now one 8-bit projection per row.
    rows, hidden, inter = 2 * 12 * 2, model.config.hidden_size, model.config.intermediate_size
    assert patched_bytes < bytes_without - 2 * rows * (hidden + 4 * inter) * 4
    flat = [torch.cat([g.flatten() for g in gs]) for gs in (patched_grads, grads)]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.99
    assert all(torch.equal(a, b) for a, b in zip(_step(model, dict(batch))[1], grads))


def test_experts_whose_activation_has_no_few_bit_table_recompute_the_gate():
    from transformers.activations import ACT2FN

    model, batch = more_model("mixtral")
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for module in experts:
        module.act_fn = ACT2FN["relu2"]
    loss, grads, nbytes = _step(model, batch)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("fewbit", fused_loss=False))
    described = [d for p, d in handle.patched.items() if p.endswith(".mlp.experts")]
    assert len(described) == 2 and all("gate recomputed" in d for d in described)
    patched_loss, patched_grads, patched_bytes = _step(model, batch)
    handle.revert()
    assert torch.equal(patched_loss, loss) and patched_bytes < nbytes
    for exact, got in zip(grads, patched_grads):
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-6)


def _lora_on_experts(name, r=4):
    """A tiny ``name`` with PEFT LoRA of rank ``r`` on q, v and the experts' 3-D weights
    (target_parameters)."""
    import peft

    if name == "gpt_oss":
        model, batch = tiny_model(name), tiny_batch(name)
    else:
        model, batch = more_model(name)
    lora = peft.LoraConfig(
        r=r,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    return peft.get_peft_model(model, lora).train(), batch


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_lora_on_the_expert_weights_trains_through_the_compressed_experts(name):
    # PEFT's target_parameters wraps the experts' 3-D weights (base + low-rank delta): the op
    # takes the effective weights as inputs, so the adapters get their gradients through it
    # (gpt-oss's transposed, biased experts through the op that recomputes their gate).
    model, batch = _lora_on_experts(name)
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


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_lora_folded_expert_weights_are_folded_again_in_backward_not_kept(name, monkeypatch):
    """PEFT folds base + scaling * lhs @ rhs into a merged copy of each layer's expert weights
    every forward. Where the base trains too (its full gradient needed), the experts ops
    (few-bit for Mixtral, the recomputed gate for gpt-oss) keep how to fold it again instead of
    the copy: the same gradients bit for bit, without the copies' bytes."""
    from hf_actq.ops import moe_routing

    model, batch = _lora_on_experts(name)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for module in experts:
        for weight in ("gate_up_proj", "down_proj"):
            getattr(module, weight).requires_grad_()
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    copies = sum(getattr(m, w).nbytes for m in experts for w in ("gate_up_proj", "down_proj"))
    torch.manual_seed(0)
    _, refolded, refolded_bytes = _step(model, batch)
    monkeypatch.setattr(moe_routing, "refolded", lambda module, name, wrappers=None: None)
    torch.manual_seed(0)
    _, kept, kept_bytes = _step(model, batch)
    assert refolded_bytes <= kept_bytes - copies
    assert len(refolded) == len(kept) == sum(p.requires_grad for p in model.parameters())
    for got, want in zip(refolded, kept):
        assert torch.equal(got, want)


# Both layouts (gpt-oss's transposed), a rank padded to 8 and one that is not.
@pytest.mark.parametrize(("name", "rank"), [("mixtral", 8), ("gpt_oss", 4)])
def test_lora_expert_weights_take_their_factors_gradients_without_the_full_weight_gradient(
    name, rank, monkeypatch
):
    """With one adapter on frozen experts, backward multiplies by the weight as base plus the
    rank-r path (a rank not a multiple of 8 padded with zeros) and gives lhs and rhs their
    gradients from r-wide products: no fold again, no [experts, out, in] gradient, the loss bit
    for bit and the adapters' gradients those of folding again up to rounding, the same saved
    bytes."""
    from hf_actq.ops import moe_routing

    model, batch = _lora_on_experts(name, r=rank)
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    full_shapes = {getattr(m, w).shape for m in experts for w in ("gate_up_proj", "down_proj")}
    shapes, folds = [], []
    expert_weight_grads = moe_routing.expert_weight_grads

    def recorded(grad_rows, input_rows, offsets, weight):
        shapes.append(weight.shape)
        return expert_weight_grads(grad_rows, input_rows, offsets, weight)

    refold = moe_routing.RefoldedWeight.__call__
    monkeypatch.setattr(moe_routing, "expert_weight_grads", recorded)
    monkeypatch.setattr(
        moe_routing.RefoldedWeight, "__call__", lambda self: folds.append(1) or refold(self)
    )
    torch.manual_seed(0)
    loss, grads, nbytes = _step(model, batch)
    assert not folds and shapes and not full_shapes & set(shapes)
    monkeypatch.setattr(moe_routing.RefoldedWeight, "low_rank", lambda self: None)
    torch.manual_seed(0)
    folded_loss, folded_grads, folded_bytes = _step(model, batch)
    assert folds and full_shapes <= set(shapes)  # the other path does both
    assert torch.equal(loss, folded_loss) and nbytes == folded_bytes
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    assert sum("experts" in n for n in names) == 8  # A and B of two wrapped weights, two layers
    assert len(grads) == len(folded_grads) == len(names)
    for name, got, want in zip(names, grads, folded_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_bf16_experts_with_fp32_adapters_keep_no_copy_of_the_adapters(name, monkeypatch):
    """PEFT keeps a bf16 model's adapters in fp32 and folds them in bf16: each forward makes
    bf16 copies of both factors, which its fold kept for backward and so did the experts ops.
    The ops make them again in backward from the adapters (PEFT's own get_delta_factors) and
    take the fold's output detached (they give the factors their gradients themselves): the
    step keeps exactly the copies' bytes less, with the same loss and gradients bit for bit."""
    import peft

    from hf_actq.ops import moe_routing

    model, batch = _lora_on_experts(name)
    model = model.to(torch.bfloat16)
    for module in model.modules():  # PEFT's default: adapters in fp32 on a bf16 model
        if hasattr(module, "lora_A"):
            module.lora_A.float(), module.lora_B.float()
    wrappers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.ParamWrapper)]
    assert len(wrappers) == 4  # two weights, two layers
    copies = sum(
        2 * (w.lora_A["default"].weight.numel() + w.lora_B["default"].weight.numel())
        for w in wrappers
    )
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    made_again = []
    factors = moe_routing._factors
    monkeypatch.setattr(
        moe_routing, "_factors", lambda *args: made_again.append(1) or factors(*args)
    )
    torch.manual_seed(0)
    loss, grads, nbytes = _step(model, batch)
    assert len(made_again) == 4
    with SavedTensorMeter(exclude=model.parameters(), model=model) as meter:
        model(**batch)
    assert not [
        p for p in meter.by_module() if isinstance(model.get_submodule(p), type(wrappers[0]))
    ]
    monkeypatch.setattr(moe_routing, "_factors_again", lambda wrapper, fold: None)
    _assert_keeps_more_alike(model, batch, (loss, grads, nbytes), copies)


def _assert_keeps_more_alike(model, batch, step, more: int) -> None:
    """Another step of ``model`` keeps ``more`` bytes than ``step`` (its loss, gradients and
    bytes) and gives the same loss and gradients bit for bit."""
    loss, grads, nbytes = step
    torch.manual_seed(0)
    kept_loss, kept_grads, kept_bytes = _step(model, batch)
    assert kept_bytes == nbytes + more
    assert torch.equal(loss, kept_loss) and len(grads) == len(kept_grads)
    for got, want in zip(grads, kept_grads):
        assert torch.equal(got, want)


def test_a_lora_router_keeps_no_copy_of_its_folded_weight(monkeypatch):
    """PEFT's LoRA on Qwen3-MoE's router ("all-linear") folds base + B A into a new weight each
    forward, which the router's linear kept for its input's gradient. The linear makes it again
    in backward with PEFT's own get_delta_weight: exactly the copies' bytes less, the same loss
    and gradients bit for bit."""
    import peft

    from hf_actq.ops import moe_router

    model, batch = more_model("qwen3_moe")
    lora = peft.LoraConfig(
        r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(model, lora).to(torch.bfloat16)
    routers = [m.mlp.gate.get_base_layer() for m in model.base_model.model.model.layers]
    copies = sum(2 * r.weight.numel() for r in routers)
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=8))
    made_again = []
    folded_again = moe_router._folded_again
    monkeypatch.setattr(
        moe_router,
        "_folded_again",
        lambda *args: made_again.append(1) or folded_again(*args),
    )
    torch.manual_seed(0)
    loss, grads, nbytes = _step(model, batch)
    assert len(made_again) == len(routers)
    monkeypatch.setattr(moe_router, "_weight_again", lambda module, state: None)
    _assert_keeps_more_alike(model, batch, (loss, grads, nbytes), copies)


def test_deberta_attention_with_exact_operands_and_dropout_gives_the_stock_gradients():
    # q, k, v kept exact: the op's backward differentiates the same core again with the
    # forward's dropout draws, so gradients are those of the same model with attention left to
    # its own code (dropout patched alike in both runs).
    results = []
    for attention in (False, True):
        model, batch = more_model("deberta-v2", dropout=0.2)
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
        model, batch = more_model(name)
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


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_frozen_experts_keep_no_copy_of_their_input(name):
    # The input's gradient needs only the weights: frozen experts (LoRA on attention alone)
    # keep nothing of it, trained ones its pack (as a linear layer's input; not the norm's
    # offered output here, which would cost them nothing), and with the router frozen nothing
    # else keeps it, so the step keeps that much less in all.
    config = ActQConfig.from_recipe("uniform", bits=8, share_norm_outputs=False)
    kept = {}
    for frozen in (False, True):
        model, batch = (
            (tiny_model(name), tiny_batch(name)) if name == "gpt_oss" else more_model(name)
        )
        for layer in model.model.layers:
            layer.mlp.requires_grad_(False)
            layer.mlp.experts.requires_grad_(not frozen)
        _, stock_grads, _ = _step(model, batch)
        hf_actq.apply(model, config)
        params = list(model.parameters())
        model.zero_grad()
        with SavedTensorMeter(exclude=params, model=model) as meter:
            loss = model(**batch).loss
        loss.backward()
        experts = {p: n for p, n in meter.by_module().items() if p.endswith("mlp.experts")}
        kept[frozen] = meter.nbytes, experts
        grads = [p.grad for p in params if p.grad is not None]
        for exact, got in zip(stock_grads, grads, strict=True):
            assert torch.nn.functional.cosine_similarity(exact.flatten(), got.flatten(), 0) > 0.99
    tokens = batch["input_ids"].numel()
    input_bytes = config.make_codec().nbytes((tokens, model.config.hidden_size))
    (trained_total, trained), (frozen_total, frozen) = kept[False], kept[True]
    assert len(frozen) == len(model.model.layers)
    assert all(frozen[path] == trained[path] - input_bytes for path in frozen)
    assert frozen_total == trained_total - len(frozen) * input_bytes


def test_under_all_linear_lora_the_router_and_the_experts_share_one_pack_of_their_input():
    # PEFT's "all-linear" LoRA trains Qwen3-MoE's router and experts (transformers 5): both
    # kept the MoE input exact. The router's linear now keeps it packed, the experts take the
    # same pack: a layer keeps tokens x hidden exact less than with the router left exact (the
    # experts' own pack is no extra), and the gradients follow stock's.
    import peft

    model, batch = more_model("qwen3_moe")
    lora = peft.LoraConfig(
        r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(model, lora)
    _, stock_grads, _ = _step(model, batch)
    kept = {}
    for router in (False, True):
        skip = [] if router else [r"mlp\.gate\.base_layer$"]
        config = ActQConfig.from_recipe("uniform", bits=8, skip_modules=skip)
        handle = hf_actq.apply(model, config)
        assert sum(p.endswith("mlp.gate.base_layer") for p in handle.patched) == 2 * router
        torch.manual_seed(0)
        _, grads, kept[router] = _step(model, batch)
        handle.revert()
        for exact, got in zip(stock_grads, grads, strict=True):
            assert torch.nn.functional.cosine_similarity(exact.flatten(), got.flatten(), 0) > 0.99
    exact_input = batch["input_ids"].numel() * model.config.hidden_size * 4
    # Nor does the patched router keep its LoRA-folded weight (made again in backward).
    folded_weight = model.config.num_experts * model.config.hidden_size * 4
    assert kept[True] == kept[False] - 2 * exact_input - 2 * folded_weight
    # And that pack is the norm's: its offered output (a form rebuilt from the norm's own pack),
    # which the block takes through its [tokens, hidden] view; without the offer the router and
    # experts pack one of their own per layer.
    moe_bytes = {}
    for share in (True, False):
        handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", share_norm_outputs=share))
        with SavedTensorMeter(exclude=list(model.parameters()), model=model) as meter:
            loss = model(**batch).loss
        loss.backward()
        handle.revert()
        moe_bytes[share] = sum(n for p, n in meter.by_module().items() if ".mlp." in p)
    pack = (
        ActQConfig.from_recipe("uniform")
        .make_codec()
        .nbytes((batch["input_ids"].numel(), model.config.hidden_size))
    )
    assert moe_bytes[False] == moe_bytes[True] + 2 * pack


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_the_checkpoint_recipe_recomputes_each_layer_with_its_forwards_routing(name):
    # "checkpoint" recomputes a layer from its rounded input; the router would route some
    # tokens of that input to other experts than the forward did (the second half fails without
    # the replay), and backward would train experts the forward never ran.
    model, batch = (tiny_model(name), tiny_batch(name)) if name == "gpt_oss" else more_model(name)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("checkpoint", bits=2))
    routed = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda _, args: routed.append(args[1]))
    for replays in (True, False):
        for layer in model.model.layers:
            layer._gradient_checkpointing_func.keywords["reparametrized"].routes_tokens = replays
        routed.clear()
        model(**batch).loss.backward()
        layers = len(model.model.layers)
        assert len(routed) == 2 * layers  # each layer's forward, then its recompute
        first, again = routed[:layers], routed[layers:][::-1]  # backward runs the last first
        same = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        assert same == replays, replays
    handle.revert()


@pytest.mark.parametrize("name", ["t5", "mixtral", "deberta-v2"])
def test_bf16_autocast_step_follows_the_unpatched_one(name):
    # The recomputing ops (DeBERTa's attention) replay the forward's autocast in backward.
    results = []
    for patched in (False, True):
        model, batch = more_model(name)
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


@pytest.mark.parametrize("name", VISION_LANGUAGE)
def test_vision_language_models_keep_the_documented_gradient_bound_at_3_bits(name):
    """docs/reference.md: "uniform" at 3 bits, whole-model gradient cosine above 0.86
    on every registered type; the vision-language models measured 0.93-0.996 (3 seeds each,
    their projectors initialised as trained ones are, not at transformers' zero)."""
    from hf_actq.testing import _cosine, metered_step

    model, batch = more_model(name)
    _, grads, _ = metered_step(model, batch)
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=3))
    torch.manual_seed(0)
    _, patched, _ = metered_step(model, batch)
    handle.revert()
    pairs = [(g, p) for g, p in zip(grads, patched) if g is not None]
    whole = _cosine(*(torch.cat([t.flatten() for t in side]) for side in zip(*pairs)))
    assert whole > 0.86, whole


def test_gemma4_soft_caps_its_fused_loss_by_its_text_configs_value():
    """Gemma 4's vision-language head soft-caps with ``text_config.final_logit_softcapping``
    (its composite config has none at its top level): the fused loss takes it from there."""
    model, batch = more_model("gemma4")
    model.config.get_text_config().final_logit_softcapping = 0.5  # small: the cap shows
    stock = model(**batch)
    stock.loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    want = [p.grad.clone() for p in params]
    model.zero_grad()
    off = dict(activations=False, linear=False, norm=False, gated_mlp=False, attention=False)
    handle = hf_actq.apply(model, ActQConfig(**off, dropout=False))
    fused = model(**batch)
    fused.loss.backward()
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, stock.loss, rtol=1e-6, atol=1e-6)
    for p, grad in zip(params, want):
        torch.testing.assert_close(p.grad, grad, rtol=1e-4, atol=1e-6)
    handle.revert()
