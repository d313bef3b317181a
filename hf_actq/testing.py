"""Tiny Hugging Face models with random weights, built from configs (no downloads): the one
fixture module of the tests, and the models the benchmarks that set the tests' bounds measure
(``benchmarks/bench_gradients.py``). As ``torchao.testing``: shipped so that benchmarks need not
import from ``tests/``.

- ``tiny_llama``, ``tiny_qwen2``, ``tiny_t5``, ``tiny_bert``: one architecture each, seed 0.
- ``tiny_model(model_type)`` and ``tiny_batch(model_type)``: every registered dense encoder and
  decoder (``TINY_SIZES``), 2 layers, 32 wide, with a 2x12-token batch.
- ``more_model(name)``: mixture-of-experts, DeBERTa-v3, ViT, CLIP, BART, T5 and vision-language
  models (``MORE_MODELS``), each with its own batch.
- ``metered_step`` and ``gradient_cosines``: one training step's gradients and saved bytes, and
  a recipe's gradient against the exact one.
- ``replicate_with_distinct_weights`` (``nn.DataParallel`` on CPU) and ``free_port`` (for
  ``accelerate launch``).
- ``CausalRows`` and ``short_training``: a causal LM dataset and ``TrainingArguments`` for a
  few logged steps on the CPU, as the multi-process ``Trainer`` tests run them.
- ``stock_checkpointing`` and ``checkpointing_argument``: transformers' own activation
  checkpointing, under its name in the installed version.
- ``host_budget`` and ``stubbed_kernels``: what a piece of code asks of the host, on the CPU
  with the Triton kernels stubbed: kernel launches, other device ops, allocations, seeds and
  host reads (the budget tests), and host time (``benchmarks/bench_host.py``).
"""

import collections
import contextlib
import dataclasses
import functools
import importlib
import os
import sys
from unittest import mock

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
    LlamaConfig,
    LlamaForCausalLM,
)

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


def stock_checkpointing(model, on: bool = True) -> None:
    """Transformers' own activation checkpointing on (or off): ``activation_checkpointing_enable``
    since transformers 5.23, ``gradient_checkpointing_enable`` before."""
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{prefix}_checkpointing_{'enable' if on else 'disable'}")()


def checkpointing_argument() -> str:
    """``TrainingArguments``' switch for it, renamed by the same release."""
    import inspect

    from transformers import TrainingArguments

    parameters = inspect.signature(TrainingArguments.__init__).parameters
    prefix = "activation" if "activation_checkpointing" in parameters else "gradient"
    return f"{prefix}_checkpointing"


def free_port() -> int:
    """A TCP port nothing listens on now, for a launch's rendezvous: launches that run side by
    side (``pytest -n``) must not both take torch's default 29500."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class CausalRows(torch.utils.data.Dataset):
    """``n`` rows of ``length`` random token ids, each its own labels."""

    def __init__(self, n: int = 16, length: int = 16, seed: int = 3):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 100, (n, length), generator=generator, device="cpu")

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def leave_launched_process() -> None:
    """End a process ``accelerate launch`` started, once its results are written and its process
    group destroyed, without the interpreter's teardown: there a gloo thread could still be
    destroyed joinable and abort the process ("terminate called without an active exception"),
    failing a run that had finished (once in a few loaded test runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def short_training(output_dir: str, steps: int = 3, batch_size: int = 2, **overrides):
    """``TrainingArguments`` for ``steps`` logged steps on the CPU, nothing saved or reported."""
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    return TrainingArguments(**{**settings, **overrides})


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


_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_DECODER = dict(_ENCODER, num_key_value_heads=2)
# head_dim given where the config's default is not hidden_size / heads (Qwen3 128, Gemma 256).
_DECODER_8 = dict(_DECODER, head_dim=8)
# DeepSeek-style experts (DeepSeek-V3, GLM-4.5): a dense first layer, then 4 routed experts (2
# per token, group-limited routing) and a shared one.
_DEEPSEEK_EXPERTS = dict(
    moe_intermediate_size=48,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
# Qwen3.5's and Qwen3-Next's hybrid decoder: a gated delta-rule layer, then an attention layer.
_HYBRID = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


TINY_SIZES = {
    "bert": _ENCODER,
    "roberta": _ENCODER,
    "xlm-roberta": _ENCODER,
    "electra": dict(_ENCODER, embedding_size=32),
    "distilbert": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64),
    "camembert": _ENCODER,
    "xlm-roberta-xl": _ENCODER,
    "roberta-prelayernorm": _ENCODER,
    "data2vec-text": _ENCODER,
    "ernie": _ENCODER,
    "albert": dict(_ENCODER, embedding_size=16),
    "esm": _ENCODER,
    # Local attention over 4 tokens in every other layer, so that the 12-token batches see it.
    "modernbert": dict(
        _ENCODER, local_attention=4, global_attn_every_n_layers=2, cls_token_id=1, sep_token_id=2
    ),
    "deberta-v2": _ENCODER,
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4),
    "gpt_neox": _ENCODER,
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "phi3": _DECODER,
    "qwen3": _DECODER_8,
    "gemma": _DECODER_8,
    "gemma2": _DECODER_8,
    # Decoders registered by layout alone; a 4-token sliding window where the model has one,
    # so that the 12-token batches see it.
    "ministral": dict(_DECODER_8, sliding_window=4),
    "smollm3": _DECODER_8,
    "olmo": _DECODER_8,
    "olmo2": _DECODER_8,
    "starcoder2": dict(_DECODER_8, sliding_window=4),
    "stablelm": _DECODER_8,
    "phi": _DECODER_8,
    "glm": _DECODER_8,
    "exaone4": dict(_DECODER_8, sliding_window=4),
    "gemma3_text": dict(_DECODER_8, sliding_window=4),
    # Heads that scale their logits (Cohere by logit_scale, 0.0625 by default).
    "granite": dict(_DECODER_8, logits_scaling=4.0),
    "cohere": _DECODER_8,
    "helium": _DECODER_8,
    "seed_oss": _DECODER_8,
    "ernie4_5": _DECODER_8,
    "hunyuan_v1_dense": _DECODER_8,
    "glm4": _DECODER_8,
    "olmo3": dict(_DECODER_8, sliding_window=4),
    "cohere2": dict(_DECODER_8, sliding_window=4),
    "ministral3": _DECODER_8,
    # Gemma 4: sliding and full layers (16-wide heads, partial RoPE), the last one reusing the one
    # before's k and v, 4-wide per-layer token inputs from a vocabulary of 100 (262,144 by
    # default).
    "gemma4_text": dict(
        _DECODER_8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        num_hidden_layers=3,
        num_kv_shared_layers=1,
        global_head_dim=16,
        vocab_size_per_layer_input=100,
        hidden_size_per_layer_input=4,
    ),
    # Qwen3.5: a gated delta-rule layer, then an attention layer (three in four by default).
    "qwen3_5_text": dict(_DECODER_8, **_HYBRID),
    # Eager attention with sinks and a 4-token sliding window in every other layer; 4 experts.
    "gpt_oss": dict(_DECODER_8, sliding_window=4, num_local_experts=4, num_experts_per_tok=2),
    # DeepSeek-V3: multi-head latent attention (low-rank q and kv, a value head narrower than
    # the query's), then the DeepSeek-style experts, in 2 groups.
    "deepseek_v3": dict(
        _ENCODER,
        num_key_value_heads=4,
        head_dim=4,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        q_lora_rank=16,
        kv_lora_rank=16,
        **_DEEPSEEK_EXPERTS,
        n_group=2,
        topk_group=1,
    ),
    # ERNIE 4.5 MoE: a dense first layer, then 4 experts (2 per token) and a shared one.
    "ernie4_5_moe": dict(
        _DECODER_8,
        moe_intermediate_size=48,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    # GLM-4.5: the DeepSeek-style experts in one group.
    "glm4_moe": dict(_DECODER_8, **_DEEPSEEK_EXPERTS, n_group=1, topk_group=1),
}
ENCODERS = {
    "bert", "roberta", "xlm-roberta", "electra", "distilbert", "deberta-v2", "camembert",
    "xlm-roberta-xl", "roberta-prelayernorm", "data2vec-text", "ernie", "albert", "modernbert",
    "esm",
}  # fmt: skip
NO_DROPOUT = {
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "seq_classif_dropout": 0.0,
    "hidden_dropout": 0.0,
    "residual_dropout": 0.0,
    "embedding_dropout": 0.0,
    "classifier_dropout_prob": 0.0,  # ALBERT's head
}


def tiny_model(model_type: str, dropout: bool = False, **overrides):
    """A 2-layer, 32-wide ``model_type`` in training mode (seed 0): a 2-label classifier for
    encoders, a causal LM otherwise; every dropout at 0 unless ``dropout``."""
    kwargs = dict(
        TINY_SIZES[model_type], vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    if not dropout:
        kwargs.update(NO_DROPOUT)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    if model_type == "distilbert":
        config.dropout = config.attention_dropout = 0.0 if not dropout else 0.1
    torch.manual_seed(0)
    auto = AutoModelForSequenceClassification if model_type in ENCODERS else AutoModelForCausalLM
    if model_type in ENCODERS:
        config.num_labels = 2
    return auto.from_config(config).train()


def tiny_batch(model_type: str) -> dict:
    """Two 12-token sequences (seed 1), labelled for ``tiny_model(model_type)``."""
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (2, 12))
    labels = torch.tensor([0, 1]) if model_type in ENCODERS else ids
    return dict(input_ids=ids, labels=labels)


def metered_step(model, batch):
    """One forward and backward: the forward's output, every parameter's gradient (None where it
    has none) and the bytes autograd kept for backward."""
    from hf_actq.memory.meter import SavedTensorMeter

    model.zero_grad()
    params = list(model.parameters())
    with SavedTensorMeter(exclude=params) as meter:
        out = model(**batch, output_hidden_states=True)
    out.loss.backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    # A patched causal LM trains without logits (the fused loss): the forward's exactness shows
    # in the last hidden states, compared for patched and unpatched decoders alike.
    forward = out.logits if hasattr(model, "num_labels") else out.hidden_states[-1]
    return forward.detach(), grads, meter.nbytes


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def gradient_cosines(model_type: str, config, batch=None):
    """Cosine with the exact gradient of one step of ``tiny_model(model_type)`` under ``config``:
    the whole model's, and each parameter tensor's (leaving out tensors whose exact gradient is
    zero up to rounding, like attention key biases, which a softmax cannot see). Stochastic
    rounding seeds from ``torch.manual_seed(0)``."""
    import hf_actq

    model = tiny_model(model_type)
    batch = batch or tiny_batch(model_type)
    _, grads, nbytes = metered_step(model, batch)
    handle = hf_actq.apply(model, config)
    torch.manual_seed(0)
    _, patched_grads, patched_bytes = metered_step(model, batch)
    handle.revert()
    if patched_bytes >= nbytes:
        raise AssertionError(f"{model_type}: {patched_bytes} bytes kept, unpatched {nbytes}")
    pairs = [(g, p) for g, p in zip(grads, patched_grads) if g is not None]
    whole = _cosine(
        torch.cat([g.flatten() for g, _ in pairs]), torch.cat([p.flatten() for _, p in pairs])
    )
    scale = max(g.norm() for g, _ in pairs)
    per_tensor = [_cosine(g, p) for g, p in pairs if g.norm() > 1e-4 * scale]
    return whole, per_tensor


def _vit():
    config = AutoConfig.for_model(
        "vit",
        image_size=32,
        patch_size=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **_ENCODER,
    )
    batch = dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 2]))
    return AutoModelForImageClassification.from_config(config), batch


def _clip():
    config = CLIPConfig(
        text_config=dict(vocab_size=100, bos_token_id=1, eos_token_id=2, **_ENCODER),
        vision_config=dict(image_size=32, patch_size=8, **_ENCODER),
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
    # Four experts, two per token; Qwen2-MoE, Qwen3-Next and Qwen3.5-MoE add a shared expert (a
    # dense gated MLP).
    config = AutoConfig.for_model(
        model_type,
        **(_HYBRID if model_type in ("qwen3_next", "qwen3_5_moe_text") else {}),
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
        **_ENCODER,
    )
    ids = torch.randint(3, 100, (2, 14))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2]))
    return AutoModelForSequenceClassification.from_config(config), batch


# Vision-language models: a 32x32 image in 8x8 patches, its tokens at positions 2.. of a
# 128-token vocabulary (image token 120), the loss on the text tokens.
_LANGUAGE = dict(_ENCODER, num_key_value_heads=2, head_dim=8, vocab_size=128)
_VISION = dict(_ENCODER, image_size=32, patch_size=8)


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


def _qwen_vl(model_type, vision, text=None, **tokens):
    # Qwen2-VL / Qwen2.5-VL / Qwen3.5: two 16x16 images in 4x4 patches (Qwen2-VL's vision
    # attention runs one image at a time), 2x2 patches merged into each of an image's 4 tokens;
    # M-RoPE (Qwen2-VL, Qwen2.5-VL) or the given text config.
    if text is None:
        text = dict(_LANGUAGE, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]})
        text.pop("head_dim")
    vision = dict(vision, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, image_token_id=120,
        video_token_id=121, vision_start_token_id=122, **tokens,
    )  # fmt: skip
    batch = _image_batch(4, token_types=False)
    batch["pixel_values"] = torch.randn(2 * 16, 3 * 2 * 4 * 4)
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 4, 4]])
    batch["mm_token_type_ids"] = (batch["input_ids"] == 120).long()
    return AutoModelForImageTextToText.from_config(config), batch


def _qwen3_5_vl(model_type, **text):
    # Qwen3.5 (dense or with experts): its ViT before the hybrid decoder (a gated delta-rule
    # layer, then attention with partial RoPE).
    vision = dict(
        depth=2, hidden_size=32, out_hidden_size=32, num_heads=4, intermediate_size=64,
        num_position_embeddings=16,
    )  # fmt: skip
    text = dict(_LANGUAGE, **_HYBRID, **text)
    return _qwen_vl(model_type, vision, text, vision_end_token_id=123)


def _gemma4():
    # A ViT (RoPE per image axis, its 4x4 patches pooled 2x2 into each image's 4 tokens) before
    # the tiny Gemma 4 decoder.
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, patch_size=4, pooling_kernel_size=2,
        position_embedding_size=64,
    )  # fmt: skip
    text = dict(TINY_SIZES["gemma4_text"], vocab_size=128, pad_token_id=0)
    config = AutoConfig.for_model(
        "gemma4", text_config=text, vision_config=vision, image_token_id=120, boi_token_id=121,
        eoi_token_id=122, video_token_id=123, audio_token_id=124, boa_token_id=125,
        eoa_token_index=126,
    )  # fmt: skip
    batch = _image_batch(4, token_types=False)
    batch["pixel_values"] = torch.rand(2, 16, 3 * 4 * 4)
    grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1)
    batch["image_position_ids"] = grid.reshape(16, 2).expand(2, 16, 2).clone()
    return AutoModelForImageTextToText.from_config(config), batch


MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "qwen3_next", "qwen3_5_moe_text")

MORE_MODELS = {
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
    "gemma4": _gemma4,
    "qwen3_5": lambda: _qwen3_5_vl("qwen3_5"),
    "qwen3_5_moe": lambda: _qwen3_5_vl(
        "qwen3_5_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
    ),
}


def more_model(name: str, **options):
    """``MORE_MODELS[name]`` (given ``options``, e.g. DeBERTa's ``dropout``), seed 0, in
    training mode, with its batch."""
    torch.manual_seed(0)
    model, batch = MORE_MODELS[name](**options)
    return model.train(), batch


def hybrid_model(name: str):
    """A tiny model of the Qwen3.5 family (``qwen3_5_text``, or ``qwen3_next``,
    ``qwen3_5_moe_text`` from ``MORE_MODELS``) and its batch."""
    if name == "qwen3_5_text":
        return tiny_model(name), tiny_batch(name)
    return more_model(name)


# A Qwen3.5-family model with every op off but attention (its gated output too) and the
# linear-attention mixers, and those exact: their own ops alone, each checked against stock.
HYBRID_EXACT = dict(
    linear=False,
    norm=False,
    gated_mlp=False,
    activations=False,
    dropout=False,
    fused_loss=False,
    share_norm_outputs=False,
    slots={
        "re:linear_attn:input$": {"codec": "exact"},
        "re:self_attn:(q|k|v|output|gate)$": {"codec": "exact"},
    },
)


def routed_tokens(tokens: int, hidden: int, experts: int, top_k: int, dtype=torch.float32):
    """MoE experts' inputs (seed 1): ``(hidden states, top-k expert ids, top-k weights)``, two
    distinct experts per token, the last expert routed no token (empty groups must work)."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(1)
    hidden_states = torch.randn(tokens, hidden, generator=generator).to(dtype)
    logits = torch.randn(tokens, experts - 1, generator=generator)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return hidden_states, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def experts_step(forward, experts, hidden, index, weights, grad, metered: bool = True):
    """One forward and backward of ``forward`` (an ``ExpertsInterface`` function) on
    ``experts``: ``(output, {input, routing weights and parameter name: gradient}, bytes kept
    for backward)`` (no meter where ``metered`` is False: torch.func, which a compiled backward
    may run, takes no saved-tensor hooks)."""
    from hf_actq.memory.meter import SavedTensorMeter

    hidden = hidden.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    experts.zero_grad()
    meter = SavedTensorMeter(exclude=list(experts.parameters()))
    with meter if metered else contextlib.nullcontext():
        out = forward(experts, hidden, index, weights)
    out.backward(grad)
    grads = {"hidden": hidden.grad, "routing weights": weights.grad}
    grads.update({name: p.grad for name, p in experts.named_parameters()})
    return out, grads, meter.nbytes if metered else None


# Host budgets ----------------------------------------------------------------------------------
# ATen ops that launch no device kernel: views, metadata, allocation, the host's own reads, and
# conversions and copies that had nothing to do (a composite op that does launch has a child
# that is counted instead).
_NO_LAUNCH = {
    "aten::empty", "aten::empty_strided", "aten::view", "aten::_unsafe_view", "aten::reshape",
    "aten::as_strided", "aten::expand", "aten::t", "aten::transpose", "aten::permute",
    "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice", "aten::detach",
    "aten::alias", "aten::lift_fresh", "aten::split", "aten::unbind", "aten::chunk",
    "aten::narrow", "aten::view_as", "aten::_reshape_alias", "aten::resolve_conj",
    "aten::resolve_neg", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
    "aten::result_type", "aten::promote_types", "aten::contiguous", "aten::flatten",
    "aten::unflatten", "aten::movedim", "aten::expand_as", "aten::split_with_sizes", "aten::to",
    "aten::type_as",
}  # fmt: skip


@dataclasses.dataclass
class HostBudget:
    """What code asked of the host (see :func:`host_budget`)."""

    triton_launches: collections.Counter  # kernel name -> launches
    device_ops: int  # ATen ops that would launch a kernel on a GPU (leaf ops, no views)
    allocations: int  # aten::empty / empty_strided calls, nested ones included
    host_reads: int  # aten::_local_scalar_dense (.item(), bool(tensor)): a sync on a GPU
    seeds: int  # seeds drawn on the host for stochastic rounding (hf_actq.codecs.draw_seed)

    @property
    def launches(self) -> int:
        """Device launches: Triton kernels and the other leaf ops."""
        return sum(self.triton_launches.values()) + self.device_ops


@contextlib.contextmanager
def stubbed_kernels():
    """CPU tensors take the path CUDA tensors take, with every hf_actq Triton kernel replaced by
    a stub that only counts its launches (the outputs are garbage), and seeds drawn as a
    counter: launchers, allocations and dispatch run as on a GPU, in no time on the device's
    side. The fused few-bit forward runs as on a GPU where its probe (one read of the device per
    activation and dtype in a process) found it exact. Yields ``(launches, seeds)``: a Counter of
    kernel name -> launches and a one-item list holding the seeds drawn."""
    import pkgutil

    import hf_actq.kernels
    from hf_actq.kernels import fewbit
    from hf_actq.kernels.registry import kernels_on_cpu

    launches = collections.Counter()
    seeds = [0]

    class _Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.name] += 1

            return launch

    def draw_seed() -> int:
        seeds[0] += 1
        return 1234 + seeds[0]

    patches = []
    for info in pkgutil.iter_modules(hf_actq.kernels.__path__):
        module = importlib.import_module(f"hf_actq.kernels.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "fn"):  # a triton.jit function
                patches.append(mock.patch.object(module, name, _Stub(name)))
    for name, module in list(sys.modules.items()):
        if name.startswith("hf_actq") and getattr(module, "draw_seed", None) is not None:
            patches.append(mock.patch.object(module, "draw_seed", draw_seed))

    def probe_passes(activation, *args):
        return fewbit.EXACT_OPTION_CANDIDATES[0] if activation in fewbit.FUSED_ACTIVATIONS else None

    patches.append(mock.patch.dict(fewbit.EXACT_FORWARD, clear=True))
    patches.append(mock.patch.object(fewbit, "_probe_exact_forward", probe_passes))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(kernels_on_cpu())
        yield launches, seeds


@contextlib.contextmanager
def host_budget():
    """Count what the code in the block asks of the host, on the CPU, under
    :func:`stubbed_kernels`. Yields a :class:`HostBudget`, filled when the block ends. Seeds are
    drawn as a counter (``draw_seed``'s own ``.item()`` is a CPU read, not a sync), so
    ``host_reads`` counts the reads that would wait for a GPU.
    """
    from torch.profiler import ProfilerActivity, profile

    with stubbed_kernels() as (launches, seeds):
        budget = HostBudget(launches, 0, 0, 0, 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield budget
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    budget.allocations = sum(e.name in ("aten::empty", "aten::empty_strided") for e in events)
    budget.host_reads = sum(e.name == "aten::_local_scalar_dense" for e in events)
    budget.seeds = seeds[0]
    budget.device_ops = sum(
        e.name not in _NO_LAUNCH
        and not any(child.name.startswith("aten::") for child in e.cpu_children)
        for e in events
    )
