"""Supervised instruction tuning of a causal LM (LLaMA, Mistral, Qwen, ...) with LoRA or QLoRA and
hf_actq: Alpaca-format data and prompt, loss on the response tokens only, ``Trainer`` with
``ActQCallback``, a held-out split, and a results file per run with the held-out loss, the
activation memory autograd kept, the step's peak memory, the step time and the config.

    python recipes/llama_lora/run.py --model_name_or_path <model dir or hub id> \\
        --data_path <alpaca.json or hub id> --recipe alam --bits 1 \\
        --output_dir runs/lora-alam1 --per_device_train_batch_size 8 --max_steps 200
    accelerate launch recipes/llama_lora/run.py <the same arguments>
    python recipes/llama_lora/run.py my_run.json          # every argument in one JSON file

Arguments: the model, data and LoRA arguments below, every ``ActQConfig`` field (``--recipe``,
``--bits``, ...; ``--recipe`` starts from a named recipe and explicit fields override it),
``--no_actq`` for the unpatched baseline (metered the same way), and all of
``TrainingArguments`` (``--gradient_checkpointing``, ``--bf16``, ``--group_by_length``, ...).

Data: ``--data_path``, a local JSON or JSONL file of ``instruction``/``input``/``output``
records, or a hub dataset id with those columns (``tatsu-lab/alpaca``). Examples are formatted
with the Alpaca prompt (with or without input), followed by the response and EOS; the labels
mask the prompt (``-100``), so only response tokens count in the loss. ``--packing``
concatenates examples into blocks of ``--max_seq_length`` tokens (attention then crosses
example boundaries within a block, as in classic packing); otherwise batches pad to their
longest example. A held-out share (``--validation_split_percentage``, drawn with a fixed seed)
gives the eval loss.

Model: ``--use_lora`` (default) wraps the model with PEFT LoRA (``--lora_r``, ``--lora_alpha``,
``--lora_dropout``, ``--lora_target_modules``, default every linear layer but the head);
``--no_use_lora`` trains every weight. ``--qlora`` loads the base in bitsandbytes 4-bit nf4
and runs ``prepare_model_for_kbit_training`` first.

Written to ``--output_dir`` on the main process: ``actq_results.json`` and ``actq_results.md``.
Needs ``pip install -e ".[recipes,peft]"`` (``[qlora]`` for ``--qlora``).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: common/ is shared

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from common.paths import looks_local, require_paths
from common.records import (
    RecipeArguments,
    recipe_callbacks,
    record_markdown_rows,
    resume_checkpoint,
    run_record,
    setup_logging,
    write_results,
)
from hf_actq import ActQConfig
from hf_actq.integrations.arguments import parse_arguments

logger = logging.getLogger("recipes.llama_lora")

IGNORE_INDEX = -100
# The Alpaca prompt (Taori et al., 2023), as in stanford_alpaca's train.py.
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A causal LM directory or hub id."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer directory or id, if not the model's."}
    )
    use_lora: bool = field(
        default=True, metadata={"help": "Train LoRA adapters; --no_use_lora trains every weight."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "Comma-separated module names to adapt (q_proj,v_proj), or 'all-linear' "
            "for every linear layer but the output head."
        },
    )
    save_model: bool = field(
        default=False,
        metadata={
            "help": "Save the trained model (adapters under LoRA) and the tokenizer to "
            "<output_dir>/model at the end."
        },
    )
    qlora: bool = field(
        default=False,
        metadata={
            "help": "Load the base model in bitsandbytes 4-bit nf4 (QLoRA) and prepare it "
            "with peft.prepare_model_for_kbit_training."
        },
    )


@dataclass
class DataArguments:
    data_path: str = field(
        metadata={"help": "Alpaca-format JSON/JSONL file (instruction, input, output) or hub id."}
    )
    max_seq_length: int = field(
        default=512, metadata={"help": "Examples are truncated to (or packed into) this length."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Concatenate examples into blocks of max_seq_length tokens."},
    )
    train_on_prompt: bool = field(
        default=False,
        metadata={
            "help": "Count the prompt tokens in the loss too (language-model training "
            "on the whole example); by default only the response counts."
        },
    )
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "Share of the examples held out for the eval loss."}
    )
    skip_train_samples: int = field(
        default=0,
        metadata={
            "help": "Leave out the first this many (shuffled) training examples, e.g. those a "
            "model was pretrained on."
        },
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Train on the first this many (shuffled) examples after the skipped."},
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on the first this many held-out examples."}
    )


# Data ------------------------------------------------------------------------------------------
def load_records(path: str):
    """The examples as a ``datasets.Dataset`` with ``instruction``, ``input``, ``output``."""
    import datasets

    if Path(path).exists():
        dataset = datasets.load_dataset("json", data_files=path, split="train")
    else:
        dataset = datasets.load_dataset(path, split="train")
    missing = {"instruction", "output"} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"{path}: Alpaca-format records need 'instruction' and 'output' (and optionally "
            f"'input') fields; missing {sorted(missing)}"
        )
    if "input" not in dataset.column_names:
        dataset = dataset.add_column("input", [""] * len(dataset))
    return dataset


def prompt_of(instruction: str, input_text: str | None) -> str:
    if input_text:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_WITHOUT_INPUT.format(instruction=instruction)


def tokenize_example(
    tokenizer, example: dict, max_length: int, train_on_prompt: bool = False
) -> dict:
    """Prompt + response + EOS, with the prompt's labels masked unless ``train_on_prompt``;
    truncated to ``max_length``."""
    prompt = tokenizer(prompt_of(example["instruction"], example["input"]))["input_ids"]
    response = tokenizer(example["output"], add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        response = response + [tokenizer.eos_token_id]
    ids = (prompt + response)[:max_length]
    labels = ((prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)) + response)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def pack(batch: dict, block: int) -> dict:
    """Concatenate tokenized examples and cut the stream into blocks of ``block`` tokens (the
    remainder is dropped)."""
    out = {}
    for key in ("input_ids", "attention_mask", "labels"):
        stream = [token for row in batch[key] for token in row]
        usable = len(stream) // block * block
        out[key] = [stream[i : i + block] for i in range(0, usable, block)]
    return out


def build_datasets(data: DataArguments, tokenizer, training_args):
    records = load_records(data.data_path).shuffle(seed=0)  # the same split for every run
    held_out = max(1, int(len(records) * data.validation_split_percentage / 100))
    split = records.train_test_split(test_size=held_out, shuffle=False)
    train, dev = split["train"], split["test"]
    if data.skip_train_samples:
        if data.skip_train_samples >= len(train):
            raise ValueError(
                f"--skip_train_samples {data.skip_train_samples} leaves no training examples "
                f"(the split has {len(train)})"
            )
        train = train.select(range(data.skip_train_samples, len(train)))
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if data.max_eval_samples is not None:
        dev = dev.select(range(min(data.max_eval_samples, len(dev))))
    columns = train.column_names
    with training_args.main_process_first(desc="tokenizing"):
        train, dev = (
            part.map(
                lambda example: tokenize_example(
                    tokenizer, example, data.max_seq_length, data.train_on_prompt
                ),
                remove_columns=columns,
            )
            for part in (train, dev)
        )
        if data.packing:
            train, dev = (
                part.map(lambda batch: pack(batch, data.max_seq_length), batched=True)
                for part in (train, dev)
            )
        # An example whose response was cut off entirely has no token to learn from: its loss
        # is 0/0 and it would only dilute the batch it lands in.
        kept = [part.filter(has_supervised_token) for part in (train, dev)]
        dropped = {"training": len(train) - len(kept[0]), "held-out": len(dev) - len(kept[1])}
        train, dev = kept
    for name, count in dropped.items():
        if count:
            logger.warning(
                "%d %s examples have no response token left within --max_seq_length %d; dropped",
                count,
                name,
                data.max_seq_length,
            )
    for name, part in (("training", train), ("held-out", dev)):
        if len(part) == 0:
            raise ValueError(
                f"the {name} split is empty after tokenization; it needs examples whose "
                f"response starts within --max_seq_length ({data.max_seq_length}) tokens, and "
                "with --packing at least that many tokens"
            )
    return train, dev, dropped


def has_supervised_token(example: dict) -> bool:
    """Whether a causal LM learns from ``example``: a label other than -100 after the first
    position (the loss predicts token i from the tokens before it)."""
    return any(label != IGNORE_INDEX for label in example["labels"][1:])


# Model -----------------------------------------------------------------------------------------
def build_model(model_args: ModelArguments, training_args):
    dtype = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else None
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if model_args.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype or torch.float32,
        )
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
    if not model_args.use_lora:
        if model_args.qlora:
            raise ValueError(
                "--qlora trains LoRA adapters on a frozen 4-bit base: drop --no_use_lora"
            )
        return model
    import peft

    if model_args.qlora:
        model = peft.prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=training_args.gradient_checkpointing,
            gradient_checkpointing_kwargs=training_args.gradient_checkpointing_kwargs,
        )
    targets = model_args.lora_target_modules
    lora = peft.LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, lora)


def parameter_counts(model) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": sum(p.numel() for p in model.parameters())}


# Main ------------------------------------------------------------------------------------------
# What the command line fills, in order (tests/recipes/test_readme_commands.py parses the
# README's commands with it).
ARGUMENTS = (ModelArguments, DataArguments, RecipeArguments, ActQConfig, TrainingArguments)


def main(args: list[str] | None = None) -> dict | None:
    model_args, data_args, recipe_args, actq, training_args = parse_arguments(ARGUMENTS, args)
    setup_logging(training_args, "recipes.llama_lora")
    config = actq if recipe_args.actq else None
    model, data = model_args.model_name_or_path, data_args.data_path
    require_paths(
        __file__,
        model_name_or_path=(
            model if looks_local(model) else None,
            "a causal LM directory; a hub id such as meta-llama/Llama-2-7b-hf downloads one",
        ),
        data_path=(
            data if looks_local(data) else None,
            "a JSON or JSONL file of Alpaca records; a hub id such as yahma/alpaca-cleaned "
            "downloads one",
        ),
    )

    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    train, dev, dropped = build_datasets(data_args, tokenizer, training_args)
    set_seed(training_args.seed)  # LoRA's initialisation
    model = build_model(model_args, training_args)
    if data_args.packing:
        collator = default_data_collator
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)

    stats, callbacks = recipe_callbacks(config, recipe_args)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=dev,
        processing_class=tokenizer,
        data_collator=collator,
        callbacks=callbacks,
    )
    checkpoint = resume_checkpoint(recipe_args, training_args, stats)
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    train_seconds = stats.train_seconds()
    metrics = trainer.evaluate()
    if model_args.save_model:
        trainer.save_model(str(Path(training_args.output_dir) / "model"))
    if not trainer.is_world_process_zero():
        return None

    record = run_record(trainer, stats, config)
    eval_loss = metrics.get("eval_loss")
    results = {
        "task": "instruction-tuning",
        "recipe": record.pop("recipe"),
        "seed": record.pop("seed"),
        "model": model_args.model_name_or_path,
        "eval_loss": eval_loss,
        "eval_perplexity": math.exp(eval_loss) if eval_loss is not None else None,
        "eval": metrics,
        "train_loss": train_result.training_loss,
        "train_seconds": round(train_seconds, 1),
        **record,
        "eval_history": [
            [entry["step"], entry["eval_loss"]]
            for entry in trainer.state.log_history
            if "eval_loss" in entry
        ],
        "parameters": parameter_counts(model),
        "training": {
            "method": "qlora" if model_args.qlora else "lora" if model_args.use_lora else "full",
            "lora_r": model_args.lora_r if model_args.use_lora else None,
            "lora_target_modules": model_args.lora_target_modules if model_args.use_lora else None,
            "learning_rate": training_args.learning_rate,
            "per_device_train_batch_size": training_args.per_device_train_batch_size,
            "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
            "gradient_checkpointing": training_args.gradient_checkpointing,
            "num_train_epochs": training_args.num_train_epochs,
            "max_steps": training_args.max_steps,
            "max_seq_length": data_args.max_seq_length,
            "packing": data_args.packing,
            "train_examples": len(train),
            "eval_examples": len(dev),
            "dropped_examples": dropped,
            "world_size": training_args.world_size,
            "precision": "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32",
        },
    }
    path = write_results(training_args.output_dir, results, results_markdown(results))
    logger.info("results in %s: eval loss %s", path, eval_loss)
    return results


def results_markdown(r: dict) -> str:
    training = r["training"]
    return (
        f"# {r['model']} / {training['method']} / {r['recipe']} / seed {r['seed']}\n\n"
        "| metric | value |\n|---|---|\n"
        f"| eval loss | {r['eval_loss']:.4f} |\n"
        f"| eval perplexity | {r['eval_perplexity']:.2f} |\n"
        f"| train loss | {r['train_loss']:.4f} |\n"
        f"| trainable parameters | {r['parameters']['trainable']:,} |\n"
        + record_markdown_rows(r)
        + f"\nConfig: `{json.dumps(r['actq'])}`\n"
    )


if __name__ == "__main__":
    main()
