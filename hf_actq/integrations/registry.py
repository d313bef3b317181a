"""Which model types hf_actq knows, as data: how each one's attention is compressed and when it
is kept exact. Everything else (linear layers, norms, dropout, activations, gated MLPs) is found
by module type in any model, registered or not.

``MODEL_TYPE_TO_APPLY_FN`` maps ``config.model_type`` to the function that patches it; add an
entry to support a new architecture (``fn(model, config, handle)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from hf_actq.config import ActQConfig
from hf_actq.integrations.attention import patch_attention
from hf_actq.integrations.causal_lm import patch_causal_lm_loss
from hf_actq.integrations.experts import patch_experts
from hf_actq.integrations.layers import patch_layers
from hf_actq.integrations.seq2seq_lm import patch_seq2seq_lm_loss
from hf_actq.ops.dedup import PackCache


@dataclass(frozen=True)
class ModelLayout:
    """``attention``: "deberta" (DeBERTa-v2/v3's disentangled attention: q, k, v, the core
    recomputed in backward), "eager" (BERT's layout through ``AttentionInterface``: q, k, v with
    SDPA recomputed in backward, or, for a model set to eager attention, q, k, v and the
    probabilities), "sdpa" (decoders: q, k, v, SDPA recomputed; only models running SDPA), or
    None (the model's own attention, kept exact, for the reason in ``note``).
    ``exact_attention_when``: (config attribute, reason) pairs; a truthy attribute keeps
    attention exact."""

    attention: str | None
    exact_attention_when: tuple[tuple[str, str], ...] = ()
    note: str = ""
    # The causal-LM head's forward is the stock pattern (base model, lm_head, optional final
    # soft-capping, loss_function), so the fused linear + cross-entropy replaces it exactly.
    causal_lm_loss: bool = False
    # What that head multiplies its logits by, from the model's config (None: 1).
    logit_scale: Callable[[object], float] | None = None
    # Its final soft-cap, from the model's config (None: the config's final_logit_softcapping).
    logit_softcap: Callable[[object], float | None] | None = None
    # The encoder-decoder head (T5, BART): see hf_actq.integrations.seq2seq_lm.
    seq2seq_lm_loss: bool = False
    # Attention's q and k are RoPE of its q_norm's and k_norm's outputs, laid out as this says
    # (hf_actq.ops.rotary.LAYOUTS): attention keeps the norms' packs instead of its own.
    qk_norm_rotary: str | None = None
    # The attention classes that layout holds for, where a model has others with q/k norms that
    # rotate otherwise (Gemma 4's vision tower: RoPE per image axis); empty: every one.
    qk_norm_rotary_classes: tuple[str, ...] = ()
    # The fewest bits attention's q, k and v take where the recipe's codec has fewer (uniform
    # rounding at these bits instead; per-slot settings and plans still decide): for attention
    # whose logits a rounding of q, k or v moves further than usual (Gemma 4's, below).
    attention_min_bits: int | None = None
    # The attention classes whose forward multiplies attention's output by a sigmoid of a gate
    # before the output projection (Qwen3.5, Qwen3-Next): the product keeps the output and the
    # gate packed (hf_actq.ops.gated_output).
    gated_output_classes: tuple[str, ...] = ()


_EAGER = ModelLayout("eager")
_EAGER_DECODER = ModelLayout("eager", causal_lm_loss=True)
_SDPA = ModelLayout("sdpa", causal_lm_loss=True)
_SDPA_SOFTCAPPED = ModelLayout(
    "sdpa",
    (("attn_logit_softcapping", "logit soft-capping needs eager attention"),),
    causal_lm_loss=True,
)
# q/k norms, then RoPE (ops/rotary.py): per head on [batch, seq, heads, dim] (Qwen3), over all
# heads (OLMo-2, OLMo-3), or on attention's own layout (Gemma 3).
_SDPA_QK_HEADS = ModelLayout("sdpa", causal_lm_loss=True, qk_norm_rotary="heads")
_SDPA_QK_FLAT = ModelLayout("sdpa", causal_lm_loss=True, qk_norm_rotary="flat")
# Qwen3.5 and Qwen3-Next (dense and with experts): Qwen3's q/k norms, and a gated output.
_QWEN3_5 = ModelLayout(
    "sdpa",
    causal_lm_loss=True,
    qk_norm_rotary="heads",
    gated_output_classes=("Qwen3_5Attention", "Qwen3_5MoeAttention", "Qwen3NextAttention"),
)
_SDPA_LOGIT_SCALE = ModelLayout(
    "sdpa", causal_lm_loss=True, logit_scale=lambda config: config.logit_scale
)
# Gemma 4 does not scale its attention logits (``scaling`` 1.0 on normalized q and k), so a
# rounding of q, k or v moves them sqrt(head_dim) times further than where logits are divided
# by sqrt(head_dim): on the tiny Gemma 4 of the tests, 4-bit q, k, v took the gradient's cosine
# with the exact one from 0.973 (attention exact) to 0.895, 8-bit ones 0.976 (docs/usage.md).
_GEMMA4 = ModelLayout(
    "sdpa",
    causal_lm_loss=True,
    qk_norm_rotary="heads",
    qk_norm_rotary_classes=("Gemma4TextAttention",),
    attention_min_bits=8,
    # The vision-language head soft-caps by its text config's value (the top level has none).
    logit_softcap=lambda config: config.get_text_config().final_logit_softcapping,
)

MODEL_LAYOUTS: dict[str, ModelLayout] = {
    "bert": _EAGER,
    "roberta": _EAGER,
    "xlm-roberta": _EAGER,
    "electra": _EAGER,
    "distilbert": _EAGER,
    # BERT's and RoBERTa's attention under other names: transformers builds them from the same
    # modular code, through AttentionInterface.
    "camembert": _EAGER,
    "xlm-roberta-xl": _EAGER,
    "roberta-prelayernorm": _EAGER,
    "data2vec-text": _EAGER,
    "ernie": _EAGER,
    # One layer's parameters shared by every layer, its attention BERT's.
    "albert": _EAGER,
    # BERT's attention with rotary or absolute positions (its GELU is a function, which the
    # few-bit recipe cannot take).
    "esm": _EAGER,
    # Its attention (global, and local through the mask's sliding window) calls
    # AttentionInterface as BERT's does; its GeGLU's activation is a module of its own.
    "modernbert": _EAGER,
    "gpt2": ModelLayout(
        "eager",
        (("reorder_and_upcast_attn", "GPT-2's reorder_and_upcast_attn path"),),
        causal_lm_loss=True,
    ),
    "gpt_neox": _EAGER_DECODER,
    "llama": _SDPA,
    "mistral": _SDPA,
    "qwen2": _SDPA,
    "qwen3": _SDPA_QK_HEADS,
    "phi3": _SDPA,
    "gemma": _SDPA,  # its RMSNorm scales by (1 + w) in fp32: found by norm.rms_norm_form
    # LLaMA-like decoders whose attention calls AttentionInterface with q, k, v, the mask and
    # scalar options only (a sliding window is in the mask; StableLM's position_ids are not
    # used by SDPA).
    "ministral": _SDPA,
    "smollm3": _SDPA,
    "olmo": _SDPA,
    "olmo2": _SDPA_QK_FLAT,
    "starcoder2": _SDPA,
    "stablelm": _SDPA,
    "phi": _SDPA,
    "glm": _SDPA,
    "exaone4": _SDPA,
    "gemma3_text": ModelLayout(
        "sdpa",
        _SDPA_SOFTCAPPED.exact_attention_when,
        causal_lm_loss=True,
        qk_norm_rotary="attention",
    ),
    # Newer LLaMA-like decoders (Helium, Seed-OSS, ERNIE 4.5, Hunyuan dense with q/k norms)
    # calling AttentionInterface as LLaMA's does.
    "helium": _SDPA,
    "seed_oss": _SDPA,
    "ernie4_5": _SDPA,
    "hunyuan_v1_dense": _SDPA,
    # GLM-4 (post-attention and post-MLP norms, a fused gate_up projection) and OLMo-3 (q/k
    # norms over all heads, a sliding window on three layers in four).
    "glm4": _SDPA,
    "olmo3": _SDPA_QK_FLAT,
    # Ministral 3: Mistral's attention, its queries scaled by position (Llama 4's attention scale).
    "ministral3": _SDPA,
    # Gemma 4: q/k norms per head before RoPE, a scale-free norm on v, layers that reuse an
    # earlier layer's k and v, per-layer token inputs; its head soft-caps when configured.
    "gemma4_text": _GEMMA4,
    # Gemma 4 as released: its vision tower's attention (q/k/v norms, unscaled logits, RoPE per
    # image axis) compressed as its decoder's, but packing q and k itself.
    "gemma4": _GEMMA4,
    # Qwen3.5: three gated delta-rule (linear attention) layers in four, whose projections and
    # norms are found by type; its attention layers gate their output and norm q and k per head.
    "qwen3_5_text": _QWEN3_5,
    # Heads that scale their logits.
    "granite": ModelLayout(
        "sdpa", causal_lm_loss=True, logit_scale=lambda config: 1 / config.logits_scaling
    ),
    "cohere": _SDPA_LOGIT_SCALE,
    "cohere2": _SDPA_LOGIT_SCALE,  # Command R7B and Command A: sliding-window layers in the mask
    # Mixture-of-experts decoders: their experts are found by structure (patch_experts).
    "mixtral": _SDPA,
    "qwen2_moe": _SDPA,
    "qwen3_moe": _SDPA_QK_HEADS,
    "olmoe": _SDPA_QK_FLAT,  # q/k norms over all heads (not where clip_qkv clamps them in place)
    # Qwen3-Next and Qwen3.5-MoE: Qwen3.5's hybrid layers (see qwen3_5_text) with experts.
    "qwen3_next": _QWEN3_5,
    "qwen3_5_moe_text": _QWEN3_5,
    "glm4_moe": _SDPA,  # GLM-4.5: group-limited routing, a shared expert
    "ernie4_5_moe": _SDPA,
    "deepseek_v3": _SDPA,  # latent attention: q, k, v (a narrower v) as AttentionInterface gets them
    # Eager attention with learned sinks (its only implementation besides vendor kernels): its
    # own eager function runs, recomputed in backward. Its experts (biased, interleaved gate
    # and up, a clamped GLU) keep their projection packed and run the gate again in backward.
    "gpt_oss": _SDPA,
    "gemma2": _SDPA_SOFTCAPPED,
    # Vision and multimodal encoders and BART (self- and cross-attention) call their attention
    # through AttentionInterface like BERT does.
    "vit": _EAGER,
    "clip": _EAGER,
    "clip_text_model": _EAGER,
    "clip_vision_model": _EAGER,
    # Vision-language models: both towers' attention goes through AttentionInterface (their
    # attention modules carry the sub-configs, which patch_attention points at the op). Their
    # ...ForConditionalGeneration heads are the stock pattern (Gemma 3's without soft-capping,
    # whose composite config has none at its top level, where the fused loss reads it).
    "gemma3": ModelLayout("sdpa", causal_lm_loss=True, qk_norm_rotary="attention"),
    "llava": _SDPA,
    "qwen2_vl": _SDPA,  # its vision attention calls the op one image at a time
    "qwen2_5_vl": _SDPA,
    # Qwen3.5 as released (dense and with experts): a ViT and the hybrid decoder of qwen3_5_text.
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    "bart": ModelLayout("eager", seq2seq_lm_loss=True),
    # T5 passes its relative position bias to the attention function, which takes its gradient;
    # only SDPA is patched (the compressed eager op has no bias input).
    "t5": ModelLayout("sdpa", seq2seq_lm_loss=True),
    "mt5": ModelLayout("sdpa", seq2seq_lm_loss=True),
    # Its own disentangled attention module, bound to an op of its own.
    "deberta-v2": ModelLayout("deberta"),
}

GENERIC = ModelLayout(None)


def apply_generic(
    model: nn.Module, config: ActQConfig, handle, layout: ModelLayout = GENERIC
) -> None:
    """Patch every known module type in ``model``, attention as ``layout`` says, and a
    registered causal LM's head and loss (``config.fused_loss``)."""
    # One pack cache for the model: the experts and their router pack the same input.
    cache = PackCache()
    exclude = patch_experts(model, config, handle, cache)
    fused = config.fused_loss and (
        (
            layout.causal_lm_loss
            and patch_causal_lm_loss(model, handle, layout.logit_scale, layout.logit_softcap)
        )
        or (layout.seq2seq_lm_loss and patch_seq2seq_lm_loss(model, handle))
    )
    if fused:
        # The fused loss reads the head's weight itself; the head runs only where the stock
        # forward does (eval, no labels, return_logits), and then exactly.
        exclude[model.get_output_embeddings()] = "the fused linear + cross-entropy computes it"
    patch_layers(model, config, handle, exclude, cache)
    patch_attention(model, config, handle, layout, cache)


MODEL_TYPE_TO_APPLY_FN = {
    model_type: functools.partial(apply_generic, layout=layout)
    for model_type, layout in MODEL_LAYOUTS.items()
}
