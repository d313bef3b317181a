"""Architecture presets for ``hf-actq memory``: the published shapes of common models, built
from their configs with random weights (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Preset:
    model_type: str
    config: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    task: str = "causal-lm"  # or "classification", "seq2seq-lm"


_BERT = dict(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
_ROBERTA = dict(
    vocab_size=50265,
    max_position_embeddings=514,
    type_vocab_size=1,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    layer_norm_eps=1e-5,
)
_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
_LARGE = dict(
    hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
)
_LLAMA2 = dict(
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_MISTRAL_7B = dict(
    _LLAMA2,
    max_position_embeddings=32768,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
)
_QWEN3 = dict(
    vocab_size=151936,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)
_FLAN_T5 = dict(
    vocab_size=32128,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)

PRESETS: dict[str, Preset] = {
    "bert-base": Preset("bert", {**_BERT, **_BASE}, task="classification"),
    "bert-large": Preset("bert", {**_BERT, **_LARGE}, task="classification"),
    "roberta-base": Preset("roberta", {**_ROBERTA, **_BASE}, task="classification"),
    "roberta-large": Preset("roberta", {**_ROBERTA, **_LARGE}, task="classification"),
    # DeBERTa-v3: disentangled attention over 256 relative-position buckets.
    "deberta-v3-base": Preset(
        "deberta-v2",
        dict(
            _BASE,
            vocab_size=128100,
            max_position_embeddings=512,
            type_vocab_size=0,
            relative_attention=True,
            position_buckets=256,
            max_relative_positions=-1,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            layer_norm_eps=1e-7,
        ),
        task="classification",
    ),
    "gpt2": Preset(
        "gpt2",
        dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    ),
    "llama2-7b": Preset(
        "llama",
        dict(
            _LLAMA2,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
        ),
        dtype=torch.bfloat16,
    ),
    "llama2-13b": Preset(
        "llama",
        dict(
            _LLAMA2,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
        ),
        dtype=torch.bfloat16,
    ),
    "mistral-7b": Preset("mistral", dict(_MISTRAL_7B, sliding_window=4096), dtype=torch.bfloat16),
    # Llama 3.1 8B: grouped-query attention, a 128,256-word vocabulary, llama3 rope scaling.
    "llama3-8b": Preset(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
        dtype=torch.bfloat16,
    ),
    # Qwen3 8B: RMSNorms on q and k, a 151,936-word vocabulary, an untied head.
    "qwen3-8b": Preset(
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
        dtype=torch.bfloat16,
    ),
    # Qwen3-30B-A3B: every layer a mixture of 128 experts (768 wide), 8 per token.
    "qwen3-30b-a3b": Preset(
        "qwen3_moe",
        dict(
            _QWEN3,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
        dtype=torch.bfloat16,
    ),
    # Gemma 3 1B (text): (1 + w) RMSNorms, four per layer and on q and k, a 512-token sliding
    # window on five layers in six, a 262k-token vocabulary.
    "gemma3-1b": Preset(
        "gemma3_text",
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            rope_theta=1e6,
            max_position_embeddings=32768,
        ),
        dtype=torch.bfloat16,
    ),
    # Gemma 3 4B: a SigLIP vision tower (27 layers, 896-pixel images as 256 tokens) and a
    # 34-layer Gemma 3 decoder with the 262k-token vocabulary; measured on text (the report
    # says so), its head under the fused loss.
    "gemma3-4b": Preset(
        "gemma3",
        dict(
            text_config=dict(
                vocab_size=262208,
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=34,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                query_pre_attn_scalar=256,
                sliding_window=1024,
                rope_theta=1e6,
                max_position_embeddings=131072,
            ),
            vision_config=dict(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=896,
                patch_size=14,
            ),
            mm_tokens_per_image=256,
        ),
        dtype=torch.bfloat16,
    ),
    # Gemma 2 2B: eager attention (its only implementation with soft-capping at 50), a
    # 4096-token sliding window on every other layer, (1 + w) RMSNorms four per layer.
    "gemma2-2b": Preset(
        "gemma2",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=8192,
        ),
        dtype=torch.bfloat16,
    ),
    # gpt-oss-20b in bf16 (as fine-tuning dequantizes its MXFP4 experts): eager attention with
    # learned sinks, a 128-token window on every other layer, 32 experts, 4 per token.
    "gpt-oss-20b": Preset(
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            rope_theta=150000.0,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
            max_position_embeddings=131072,
            pad_token_id=199999,
            eos_token_id=200002,
        ),
        dtype=torch.bfloat16,
    ),
    # Mistral-7B's shapes with eight experts per layer, two per token.
    "mixtral-8x7b": Preset(
        "mixtral",
        dict(_MISTRAL_7B, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6),
        dtype=torch.bfloat16,
    ),
    # Flan-T5 (T5 v1.1): gated-GELU feed-forward, relative position bias, untied head.
    "flan-t5-base": Preset(
        "t5",
        dict(_FLAN_T5, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12),
        task="seq2seq-lm",
    ),
    "flan-t5-large": Preset(
        "t5",
        dict(_FLAN_T5, d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_heads=16),
        task="seq2seq-lm",
    ),
    # Small shapes for quick runs and tests.
    "tiny-bert": Preset(
        "bert",
        dict(
            vocab_size=512,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=512,
        ),
        task="classification",
    ),
    "tiny-llama": Preset(
        "llama",
        dict(
            _LLAMA2,
            vocab_size=512,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),
}


PRESETS["tiny-mixtral"] = Preset(
    "mixtral",
    dict(
        _LLAMA2,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
)
PRESETS["tiny-t5"] = Preset(
    "t5",
    dict(_FLAN_T5, vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
    task="seq2seq-lm",
)


def preset_config(name: str):
    """The transformers config of a preset."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[name]
    return AutoConfig.for_model(preset.model_type, **preset.config)
