"""The tiny LLaMA the tests train (tests/ is on sys.path through its conftest; the script that
``accelerate launch`` runs adds it)."""

import sys
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

_SIZES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
)  # fmt: skip
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_llama_config(**overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaConfig(**{**settings, **overrides})


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def tiny_qwen2(**overrides):
    """Qwen2 at tiny_llama's sizes (attention biases on q, k, v; random weights, seed 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = tiny_llama_config().to_dict()
    settings = {k: settings[k] for k in _SIZES + ("num_key_value_heads",)}
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**settings, **_TOKENS, **overrides}))


def tiny_t5(**overrides):
    """A 2-layer, 32-wide T5 (random weights, seed 0, no dropout)."""
    from transformers import T5Config, T5ForConditionalGeneration

    settings = dict(
        vocab_size=100, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(**{**settings, **overrides}))


def tiny_bert(**overrides):
    """A 2-layer, 64-wide BERT classifier (random weights, seed 0)."""
    from transformers import BertConfig, BertForSequenceClassification

    settings = dict(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**{**settings, **overrides}))


def replicate_with_distinct_weights(model, replicas=2):
    """``nn.DataParallel``'s own replication (``torch.nn.parallel.replicate``) on CPU: its
    per-device broadcast (CUDA only) stood in for by copies that stay differentiable and differ
    per replica, so that a replica computing with another's weights shows in its output."""
    module = sys.modules["torch.nn.parallel.replicate"]

    def broadcast(tensors, devices, detach=False):
        def copy(t, index):
            t = t.detach() if detach else t
            return t + 0.01 * (index + 1) if t.is_floating_point() else t.clone()

        return [[copy(t, index) for t in tensors] for index in range(len(devices))]

    with mock.patch.object(module, "_broadcast_coalesced_reshape", broadcast):
        return module.replicate(model, list(range(replicas)))
