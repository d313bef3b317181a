"""The tiny LLaMA the tests train (tests/ is on sys.path through its conftest; the script that
``accelerate launch`` runs adds it)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


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
