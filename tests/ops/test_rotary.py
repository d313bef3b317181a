"""Attention's q and k taken from their q/k norms' packs through RoPE (hf_actq/ops/rotary.py)."""

import copy
from unittest import mock

import pytest
import torch
import transformers

import hf_actq
from hf_actq.codecs import AverageQuantCodec
from hf_actq.codecs.packed import ExactCodec, Packed
from hf_actq.integrations import attention as attention_patching
from hf_actq.integrations.registry import MODEL_LAYOUTS
from hf_actq.kernels.packing import allocation_bytes
from hf_actq.ops.rotary import RotaryPacked
from hf_actq.ops.state import STATE
from hf_actq.testing import MORE_MODELS, metered_step, more_model, tiny_batch, tiny_model

ROTARY_MODELS = sorted(t for t, layout in MODEL_LAYOUTS.items() if layout.qk_norm_rotary)


def _model(model_type: str):
    if model_type in MORE_MODELS:
        return more_model(model_type)
    return tiny_model(model_type), tiny_batch(model_type)


def _first_attention(model):
    """The first attention module with q/k norms that the model's layout rotates."""
    classes = MODEL_LAYOUTS[model.config.model_type].qk_norm_rotary_classes
    return next(
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
        and hasattr(m, "q_norm")
        and (not classes or type(m).__name__ in classes)
    )


def _patched(model, rotary: bool = True):
    model = copy.deepcopy(model)
    takes = attention_patching._takes_norm_offers if rotary else (lambda *args: False)
    with mock.patch.object(attention_patching, "_takes_norm_offers", takes):
        hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform"))
    return model


def test_every_registered_model_with_qk_norms_is_covered():
    assert set(ROTARY_MODELS) == {
        "gemma3", "gemma3_text", "gemma4", "gemma4_text", "olmo2", "olmo3", "olmoe", "qwen3", "qwen3_5",
        "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next",
    }  # fmt: skip


@pytest.mark.parametrize("model_type", ROTARY_MODELS)
def test_the_rotation_rebuilds_the_models_own_q_and_k_bit_for_bit(model_type):
    """The registry's layout is the model's: the norms' exact outputs, rotated as backward
    rotates their packs, are the q and k the model hands its attention function."""
    model, batch = _model(model_type)
    attention = _first_attention(model)
    seen = {}

    def keep(name):
        def hook(module, args, output):
            seen[name] = output

        return hook

    def keep_position_embeddings(module, args, kwargs):
        seen["cos_sin"] = kwargs["position_embeddings"]

    hooks = [
        attention.q_norm.register_forward_hook(keep("q_norm")),
        attention.k_norm.register_forward_hook(keep("k_norm")),
        attention.register_forward_pre_hook(keep_position_embeddings, with_kwargs=True),
    ]
    stock = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, *args, **kwargs):
        if module is attention:
            seen.setdefault("q", query), seen.setdefault("k", key)
        return stock(module, query, key, *args, **kwargs)

    try:
        functions = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
        with mock.patch.dict(functions, {"sdpa": spy}), torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    cos, sin = seen["cos_sin"]
    layout = MODEL_LAYOUTS[model_type].qk_norm_rotary
    for name in ("q", "k"):
        norm_output, operand = seen[f"{name}_norm"].contiguous(), seen[name]
        source = Packed(ExactCodec(), norm_output.shape, norm_output.dtype, (norm_output,))
        rebuilt = RotaryPacked(
            ExactCodec(), operand.shape, operand.dtype, (norm_output, cos, sin), source, layout
        )
        assert torch.equal(rebuilt.unpack(), operand)


def _pack_bytes(shape) -> int:
    codec = AverageQuantCodec(bits=4)
    return allocation_bytes(codec.layout(torch.Size(shape)))


@pytest.mark.parametrize(
    "model_type", ["qwen3", "olmo2", "gemma3_text", "qwen3_moe", "qwen3_5_text"]
)
def test_attention_keeps_the_norms_packs_instead_of_its_own(model_type):
    """Exactly the q and k packs fewer bytes, the same forward, gradients as close to stock as
    with attention's own packs (Qwen3.5: partial RoPE, and attention in one layer of two)."""
    model, batch = _model(model_type)
    config = model.config
    tokens = batch["input_ids"].numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_layer = _pack_bytes((tokens, config.num_attention_heads, head_dim)) + _pack_bytes(
        (tokens, config.num_key_value_heads, head_dim)
    )
    stock = metered_step(model, batch)
    results = {}
    for rotary in (False, True):
        torch.manual_seed(3)
        results[rotary] = metered_step(_patched(model, rotary), batch)
    own, taken = results[False], results[True]
    layers = sum(hasattr(m, "q_norm") for m in model.modules())
    assert own[2] - taken[2] == per_layer * layers
    assert torch.equal(taken[0], stock[0])

    def cosine(grads):
        flat = [torch.cat([g.flatten() for g in gs if g is not None]) for gs in (grads, stock[1])]
        return torch.nn.functional.cosine_similarity(*flat, dim=0).item()

    assert cosine(taken[1]) > cosine(own[1]) - 0.005
    assert cosine(taken[1]) > 0.98


def _doubled(module, args, output):
    return output * 2


def _hooked(model):
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.q_norm.register_forward_hook(_doubled)
    return model


def test_a_forward_hook_on_a_norm_keeps_attention_packing_its_own():
    """A hook that replaces the norm's output changes what RoPE rotates: attention must then
    pack the q it was given, or its backward would differentiate at another point."""
    model, batch = _model("qwen3")
    torch.manual_seed(3)
    want = metered_step(_hooked(_patched(model, rotary=False)), batch)
    torch.manual_seed(3)
    got = metered_step(_hooked(_patched(model)), batch)
    assert got[2] == want[2]
    for a, b in zip(got[1], want[1]):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


def test_under_non_reentrant_checkpointing_attention_packs_its_own():
    """Norms offer nothing inside a checkpointed region (its two passes would keep different
    tensors); attention packs q and k as before, and gradients follow."""
    model, batch = _model("qwen3")
    got, want = {}, {}
    for rotary, sink in ((True, got), (False, want)):
        patched = _patched(model, rotary)
        patched.gradient_checkpointing_enable({"use_reentrant": False})
        torch.manual_seed(3)
        sink["step"] = metered_step(patched, batch)
    assert got["step"][2] == want["step"][2]
    for a, b in zip(got["step"][1], want["step"][1]):
        assert a is None or torch.equal(a, b)


def test_no_norm_holds_an_offer_after_the_step():
    """The q/k norms hold their latest offer only while their attention module's forward runs,
    and no other norm records one: nothing of a step (an unpacked tensor some consumer never
    asked for) outlives its graph through them."""
    model, batch = _model("qwen3")
    patched = _patched(model)
    metered_step(patched, batch)
    states = [m.__dict__[STATE] for m in patched.modules() if STATE in m.__dict__]
    assert sum(s.record_offer for s in states) == 2 * model.config.num_hidden_layers
    assert all(s.offered is None for s in states)


def test_revert_restores_the_attention_modules_forward():
    model, _ = _model("qwen3")
    patched = copy.deepcopy(model)
    handle = hf_actq.apply(patched, hf_actq.ActQConfig.from_recipe("uniform"))
    attention = _first_attention(patched)
    assert "forward" in attention.__dict__
    assert "q, k as the q/k norms' packs" in repr(attention)
    handle.revert()
    assert "forward" not in attention.__dict__
    assert set(attention.__dict__) == set(_first_attention(model).__dict__)


def test_olmoe_clamping_its_norms_outputs_in_place_keeps_attention_packing_its_own():
    """With clip_qkv, OLMoE clamps q and k in place between the norms and RoPE: the norms'
    offers are of other values, so attention is left as it was."""
    model, batch = _model("olmoe")
    model.config.clip_qkv = 0.5
    patched = copy.deepcopy(model)
    handle = hf_actq.apply(patched, hf_actq.ActQConfig.from_recipe("uniform"))
    attention = _first_attention(patched)
    assert "forward" not in attention.__dict__
    assert "q/k norms" not in handle.patched[handle_path(patched, attention)]
    torch.manual_seed(3)
    got = metered_step(patched, batch)
    torch.manual_seed(3)
    want = metered_step(_patched(model, rotary=False), batch)
    assert got[2] == want[2]
    # Set after apply: the wrapped forward sees it.
    model.config.clip_qkv = None
    late = _patched(model)
    late.config.clip_qkv = 0.5
    assert "forward" in _first_attention(late).__dict__
    torch.manual_seed(3)
    assert metered_step(late, batch)[2] == want[2]


def handle_path(model, module) -> str:
    return next(path for path, m in model.named_modules() if m is module)


def test_attention_that_rotates_otherwise_packs_its_own_q_and_k():
    """Gemma 4's vision tower normalizes q and k too but rotates them per image axis, which the
    registry's layout does not rebuild: only its decoder's attention takes the norms' packs."""
    model, batch = more_model("gemma4")
    handle = hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform", bits=8))
    rotary = {
        path: STATE in m.__dict__ and m.__dict__[STATE].qk_norm_rotary is not None
        for path, m in model.named_modules()
        if path.endswith("self_attn")
    }
    # (the decoder's last layer reuses the one before's k and v: it has no k norm to take)
    assert not any(taken for p, taken in rotary.items() if "vision" in p), rotary
    assert any(taken for p, taken in rotary.items() if "language_model" in p), rotary
    model(**batch).loss.backward()
    handle.revert()


def test_q_k_norms_pack_at_the_precision_of_the_q_and_k_they_feed():
    """Gemma 4's q and k take 8 bits under "uniform" 4 (unscaled logits): its q/k norms pack
    at 8 bits too, so attention takes their packs, one at 8 bits where a 4-bit norm pack and an
    8-bit q/k pack would be kept; a per-slot setting of the norms' own keeps both."""
    model, batch = _model("gemma4_text")
    results = {}
    for name, slots in (("follow", {}), ("own", {"re:(q|k)_norm:input$": {"bits": 4}})):
        patched = copy.deepcopy(model)
        handle = hf_actq.apply(patched, hf_actq.ActQConfig.from_recipe("uniform", slots=slots))
        norm = patched.model.layers[0].self_attn.q_norm
        results[name] = (norm.__dict__[STATE].codecs["input"].bits, metered_step(patched, batch)[2])
        assert f"bits={results[name][0]}" in handle.patched["model.layers.0.self_attn.q_norm"]
    assert results["follow"][0] == 8 and results["own"][0] == 4
    assert results["follow"][1] < results["own"][1]
