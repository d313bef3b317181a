"""The models a memory report measures: built from a config with random weights, at a chosen
depth, optionally under PEFT LoRA/QLoRA, and their inputs."""

from __future__ import annotations

import copy
import os
import tempfile

import torch

_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta-v2"}


def default_task(config) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    return "classification" if config.model_type in _ENCODER_TYPES else "causal-lm"


def max_positions(config) -> int | None:
    limit = getattr(text_config(config), "max_position_embeddings", None)
    if limit is not None and config.model_type in ("roberta", "xlm-roberta"):
        limit -= config.pad_token_id + 1  # RoBERTa's positions start after the padding index
    return limit


def fits_on_device(config, task, dtype, device) -> bool:
    with torch.device("meta"):
        model = _model_class(task, config).from_config(config, dtype=dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    on_gpu = device.type == "cuda"
    available = torch.cuda.mem_get_info(device)[0] if on_gpu else _available_ram()
    return 4 * param_bytes < available / 4


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _model_class(task, config):
    import transformers

    name = {
        "causal-lm": "AutoModelForCausalLM",
        "classification": "AutoModelForSequenceClassification",
        "seq2seq-lm": "AutoModelForSeq2SeqLM",
    }[task]
    if task == "causal-lm" and is_vision_language(config):
        name = "AutoModelForImageTextToText"  # LLaVA and Qwen-VL have no causal-LM auto class
    return getattr(transformers, name)


def text_config(config):
    """The config that holds the language model's depth, vocabulary and positions: a
    vision-language model's ``text_config``, any other model's own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_vision_language(config) -> bool:
    return not getattr(config, "is_encoder_decoder", False) and text_config(config) is not config


_DECODER_DEPTH = ("num_decoder_layers", "decoder_layers")


def decoder_layers(config) -> int | None:
    if not getattr(config, "is_encoder_decoder", False):
        return None
    return next((getattr(config, n) for n in _DECODER_DEPTH if hasattr(config, n)), None)


def build_model(config, num_layers, dtype, peft, task, device, attn_implementation=None):
    """The architecture with ``num_layers`` layers (in each stack of an encoder-decoder) and
    random weights (seed 0), PEFT-wrapped."""
    config = copy.deepcopy(config)
    text = text_config(config)
    text.num_hidden_layers = num_layers
    if isinstance(getattr(text, "layer_types", None), list):  # per-layer attention kinds
        text.layer_types = text.layer_types[:num_layers]
    for name in _DECODER_DEPTH:
        if getattr(config, "is_encoder_decoder", False) and hasattr(config, name):
            setattr(config, name, num_layers)
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    torch.manual_seed(0)
    model = _model_class(task, config).from_config(config, **kwargs)
    if peft == "none":
        return model.to(device)
    import peft as peft_lib

    if peft == "qlora":
        model = _quantize_nf4(model, dtype, task, device, kwargs)
        model = peft_lib.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = model.to(device)
    # Alpaca-LoRA's defaults (the setting of ALAM's LLaMA runs): r 8, alpha 16, dropout 0.05, and
    # PEFT's default target modules for the architecture.
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    # Named explicitly: PEFT 0.21 leaves the defaults unused for MoE models (no match, an error);
    # all linear layers for an architecture it has no defaults for.
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(config.model_type)
    lora = peft_lib.LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.05,
        target_modules=list(targets) if targets else "all-linear",
        task_type={"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}.get(task, "SEQ_CLS"),
    )
    if _targets_parameters(lora, model):
        # Under transformers 5, PEFT turns "all-linear" on experts that were linear layers in
        # transformers 4 (Qwen3-MoE's) into LoRA on their fused parameters, which takes no
        # dropout ("lora.ParamWrapper does not work with lora_dropout != 0").
        lora.lora_dropout = 0.0
    return peft_lib.get_peft_model(model, lora)


def _targets_parameters(lora, model) -> bool:
    """Whether PEFT will put ``lora`` on parameters of ``model`` (its conversion of the config
    for transformers 5, run on a copy); False where this PEFT has no such conversion."""
    try:
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
    except ImportError:
        return False
    probe = copy.deepcopy(lora)
    convert_peft_config_for_transformers(probe, model, get_model_conversion_mapping(model))
    return bool(probe.target_parameters)


def _quantize_nf4(model, dtype, task, device, kwargs):
    # bitsandbytes quantizes while loading weights, so go through a temporary checkpoint.
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
    )
    model_class = _model_class(task, model.config)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        del model
        return model_class.from_pretrained(
            directory, quantization_config=quantization, device_map={"": str(device)}, **kwargs
        )


def make_inputs(config, task, batch_size, seq_len, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    vocab_size = text_config(config).vocab_size
    low = min(4, vocab_size - 1)  # keep clear of special ids
    ids = torch.randint(low, vocab_size, (batch_size, seq_len), generator=generator, device="cpu")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "causal-lm":
        inputs["labels"] = ids
    elif task == "seq2seq-lm":  # a target as long as the source
        inputs["labels"] = torch.randint(
            low, vocab_size, (batch_size, seq_len), generator=generator, device="cpu"
        )
    else:
        labels = torch.randint(
            0, config.num_labels, (batch_size,), generator=generator, device="cpu"
        )
        inputs["labels"] = labels
    return {key: value.to(device) for key, value in inputs.items()}
