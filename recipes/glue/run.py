"""Fine-tune a sequence classifier on a GLUE task with hf_actq, in the shape of transformers'
``run_glue.py``: ``Trainer`` with ``ActQCallback``, and a results file per run with the dev
metrics, the activation memory autograd kept, the step's peak memory, the step time and the
config.

    python recipes/glue/run.py --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 \\
        --task_name mrpc --recipe checkpoint --output_dir runs/mrpc-checkpoint
    python recipes/glue/run.py --model_name_or_path <model dir> --task_name mrpc \\
        --glue_dir <dir of GLUE TSVs> --recipe fewbit --bits 3 --output_dir runs/mrpc-fewbit3
    accelerate launch recipes/glue/run.py <the same arguments>
    python recipes/glue/run.py my_run.json          # every argument in one JSON file

Arguments: this script's model and data arguments, every ``ActQConfig`` field (``--recipe``,
``--bits``, ``--no_attention``, ``--slots '{"re::input$": {"bits": 4}}'``, ``--plan plan.json``,
...; ``--recipe`` starts from a named recipe and explicit fields override it), ``--no_actq`` for
the unpatched baseline (metered the same way), and all of ``TrainingArguments``.

Data, first that applies: ``--glue_dir`` (the original GLUE TSV layout, e.g.
``<dir>/MRPC/{train,dev}.tsv``), ``--train_file``/``--validation_file`` (csv or
json with a ``label`` column and one or two text columns), else the hub dataset
``nyu-mll/glue``. Metrics: ``evaluate.load("glue", task)`` when it loads, otherwise the same
metrics from scikit-learn and scipy; the results record which.

Written to ``--output_dir`` on the main process: ``actq_results.json`` and ``actq_results.md``
(and ``actq_plan.json`` for adaptive recipes). Needs ``pip install -e ".[recipes]"``.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: common/ is shared

from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
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

logger = logging.getLogger("recipes.glue")

Task = Literal["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"]


@dataclass(frozen=True)
class TaskSpec:
    directory: str  # in the GLUE TSV layout
    dev_file: str
    tsv_columns: tuple  # text column(s) then the label column: header names, or indices
    hub_columns: tuple  # the same in nyu-mll/glue
    labels: tuple | None  # label strings of the TSV in class order; None: regression
    main_metric: str


TASKS: dict[str, TaskSpec] = {
    # CoLA's TSVs have no header: source, label, original label, sentence.
    "cola": TaskSpec("CoLA", "dev.tsv", (3, 1), ("sentence", "label"), ("0", "1"), "matthews_correlation"),
    "sst2": TaskSpec("SST-2", "dev.tsv", ("sentence", "label"), ("sentence", "label"), ("0", "1"), "accuracy"),
    "mrpc": TaskSpec("MRPC", "dev.tsv", ("#1 String", "#2 String", "Quality"), ("sentence1", "sentence2", "label"), ("0", "1"), "accuracy"),
    "stsb": TaskSpec("STS-B", "dev.tsv", ("sentence1", "sentence2", "score"), ("sentence1", "sentence2", "label"), None, "pearson"),
    "qqp": TaskSpec("QQP", "dev.tsv", ("question1", "question2", "is_duplicate"), ("question1", "question2", "label"), ("0", "1"), "accuracy"),
    "mnli": TaskSpec("MNLI", "dev_matched.tsv", ("sentence1", "sentence2", "gold_label"), ("premise", "hypothesis", "label"), ("entailment", "neutral", "contradiction"), "accuracy"),
    "qnli": TaskSpec("QNLI", "dev.tsv", ("question", "sentence", "label"), ("question", "sentence", "label"), ("entailment", "not_entailment"), "accuracy"),
    "rte": TaskSpec("RTE", "dev.tsv", ("sentence1", "sentence2", "label"), ("sentence1", "sentence2", "label"), ("entailment", "not_entailment"), "accuracy"),
    "wnli": TaskSpec("WNLI", "dev.tsv", ("sentence1", "sentence2", "label"), ("sentence1", "sentence2", "label"), ("0", "1"), "accuracy"),
}  # fmt: skip


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A model directory or hub id."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer directory or id, if not the model's."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "Reinitialise a checkpoint's head with another number of labels."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "eager, sdpa, ... (default: the model's). ALAM keeps attention "
            "probabilities, which eager attention has."
        },
    )


@dataclass
class DataArguments:
    task_name: Task | None = field(default=None, metadata={"help": "The GLUE task."})
    glue_dir: str | None = field(
        default=None,
        metadata={"help": "A directory in the GLUE TSV layout (<dir>/MRPC/train.tsv, ...)."},
    )
    train_file: str | None = field(
        default=None, metadata={"help": "csv/json training data: a 'label' and 1-2 text columns."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "csv/json dev data."})
    max_seq_length: int = field(
        default=128, metadata={"help": "Longer inputs are truncated; batches pad dynamically."}
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every example to max_seq_length (ALAM's run_glue) instead."},
    )
    drop_token_type_ids: bool = field(
        default=False,
        metadata={"help": "Leave token_type_ids out of the inputs (ALAM's run_glue deletes them)."},
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={
            "help": "Train on this many examples, drawn at random (fixed seed 0, the same for "
            "every run) from the training split."
        },
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on the first this many dev examples."}
    )


# Data ------------------------------------------------------------------------------------------
def read_glue_tsv(path: Path, spec: TaskSpec) -> dict[str, list]:
    """One split of the original GLUE TSVs as columns ``text_a``[, ``text_b``], ``label``."""
    with open(path, encoding="utf-8-sig", newline="") as file:
        rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    if isinstance(spec.tsv_columns[0], int):
        indices = list(spec.tsv_columns)
    else:
        header, rows = rows[0], rows[1:]
        missing = [c for c in spec.tsv_columns if c not in header]
        if missing:
            raise ValueError(f"{path}: no column {missing} in the header {header}")
        indices = [header.index(c) for c in spec.tsv_columns]
    columns: dict[str, list] = {name: [] for name in _column_names(len(indices) - 1)}
    for row in rows:
        if len(row) <= max(indices):
            continue  # a few GLUE rows are malformed; the reference loaders skip them too
        raw = row[indices[-1]]
        if spec.labels is None:
            label = float(raw)
        elif raw in spec.labels:
            label = spec.labels.index(raw)
        else:
            continue
        for name, index in zip(columns, indices[:-1]):
            columns[name].append(row[index])
        columns["label"].append(label)
    return columns


def _column_names(texts: int) -> list[str]:
    return ["text_a", "text_b"][:texts] + ["label"]


def load_splits(data: DataArguments):
    """(train, dev) as ``datasets.Dataset`` with ``text_a``[, ``text_b``], ``label``, and the
    number of labels (1: regression)."""
    import datasets

    spec = TASKS.get(data.task_name) if data.task_name else None
    if data.glue_dir:
        if spec is None:
            raise ValueError("--glue_dir needs --task_name (one of " + ", ".join(TASKS) + ")")
        root = Path(data.glue_dir) / spec.directory
        splits = [
            datasets.Dataset.from_dict(read_glue_tsv(root / name, spec))
            for name in ("train.tsv", spec.dev_file)
        ]
    elif data.train_file:
        if not data.validation_file:
            raise ValueError("--train_file needs --validation_file")
        kind = "json" if data.train_file.endswith((".json", ".jsonl")) else "csv"
        files = {"train": data.train_file, "validation": data.validation_file}
        loaded = datasets.load_dataset(kind, data_files=files)
        splits = [_normalise(loaded[s]) for s in ("train", "validation")]
    elif spec is not None:
        try:
            loaded = datasets.load_dataset("nyu-mll/glue", data.task_name)
        except Exception as error:
            raise ValueError(
                f"could not load nyu-mll/glue ({error}); give --glue_dir with the GLUE TSVs "
                "or --train_file/--validation_file"
            ) from error
        dev = "validation_matched" if data.task_name == "mnli" else "validation"
        texts = dict(zip(spec.hub_columns[:-1], ("text_a", "text_b")))
        splits = [_normalise(loaded[s].rename_columns(texts)) for s in ("train", dev)]
    else:
        raise ValueError("give --task_name (with --glue_dir or the hub) or --train_file")
    train, dev = splits
    if data.max_train_samples is not None and data.max_train_samples < len(train):
        train = train.shuffle(seed=0).select(range(data.max_train_samples))
    if data.max_eval_samples is not None and data.max_eval_samples < len(dev):
        dev = dev.select(range(data.max_eval_samples))
    regression = spec.labels is None if spec else train.features["label"].dtype.startswith("float")
    labels = 1 if regression else len(spec.labels) if spec else len(set(train["label"]))
    return train, dev, labels


def _normalise(split):
    """csv/json/hub splits to ``text_a``[, ``text_b``], ``label`` (sentence1/sentence2 when
    present, else the first one or two text columns, as run_glue does)."""
    if "label" not in split.column_names:
        raise ValueError(f"the data needs a 'label' column, has {split.column_names}")
    if {"sentence1", "sentence2"} <= set(split.column_names):
        texts = ["sentence1", "sentence2"]
    elif {"text_a"} <= set(split.column_names):
        texts = [c for c in ("text_a", "text_b") if c in split.column_names]
    else:
        texts = [c for c in split.column_names if c not in ("label", "idx")][:2]
    names = _column_names(len(texts))
    split = split.rename_columns(dict(zip(texts, names[:-1])))
    return split.remove_columns([c for c in split.column_names if c not in names])


# Metrics ---------------------------------------------------------------------------------------
def glue_metric(task: str | None, regression: bool):
    """``(compute(predictions, references) -> dict, source)``: evaluate's GLUE metric when it
    loads (it needs the hub), else the same figures from scikit-learn and scipy."""
    if task is not None:
        try:
            import evaluate

            metric = evaluate.load("glue", task)
            return (
                lambda p, r: metric.compute(predictions=p, references=r),
                "evaluate.load('glue')",
            )
        except Exception as error:
            logger.info("evaluate's GLUE metric did not load (%s): using scikit-learn/scipy", error)
    return (lambda p, r: sklearn_glue_metric(task, regression, p, r)), "scikit-learn/scipy"


def sklearn_glue_metric(task, regression, predictions, references) -> dict:
    """The figures ``evaluate``'s GLUE metric reports for ``task``, as fractions."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    if regression:
        return {
            "pearson": float(pearsonr(predictions, references)[0]),
            "spearmanr": float(spearmanr(predictions, references)[0]),
        }
    if task == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
    result = {"accuracy": float(accuracy_score(references, predictions))}
    if task in ("mrpc", "qqp"):
        result["f1"] = float(f1_score(references, predictions))
    return result


def check_paths(model_args: ModelArguments, data_args: DataArguments) -> None:
    """Exit in one line on a local path that is not there (the flag named), before loading."""
    model = model_args.model_name_or_path
    spec = TASKS.get(data_args.task_name) if data_args.task_name else None
    tsv = None
    if data_args.glue_dir and spec is not None and Path(data_args.glue_dir).is_dir():
        tsv = str(Path(data_args.glue_dir) / spec.directory / "train.tsv")
    require_paths(
        __file__,
        model_name_or_path=(
            model if looks_local(model) else None,
            "a model directory; a hub id such as sentence-transformers/all-MiniLM-L6-v2 "
            "downloads one",
        ),
        glue_dir=(
            data_args.glue_dir,
            "a directory of GLUE TSVs, <dir>/MRPC/train.tsv; leave it out to load "
            "nyu-mll/glue from the hub",
        ),
        train_file=(data_args.train_file, "a csv or json file"),
        validation_file=(data_args.validation_file, "a csv or json file"),
    )
    if tsv is not None:
        require_paths(__file__, glue_dir=(tsv, f"{data_args.task_name}'s training TSV"))


# Main ------------------------------------------------------------------------------------------
# What the command line fills, in order (tests/recipes/test_readme_commands.py parses the
# README's commands with it).
ARGUMENTS = (ModelArguments, DataArguments, RecipeArguments, ActQConfig, TrainingArguments)


def main(args: list[str] | None = None) -> dict | None:
    model_args, data_args, recipe_args, actq, training_args = parse_arguments(ARGUMENTS, args)
    setup_logging(training_args, "recipes.glue")
    config = actq if recipe_args.actq else None
    check_paths(model_args, data_args)

    train, dev, num_labels = load_splits(data_args)
    set_seed(training_args.seed)  # the classifier head's initialisation
    model_config = AutoConfig.from_pretrained(
        model_args.model_name_or_path, num_labels=num_labels, finetuning_task=data_args.task_name
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        config=model_config,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        **({"attn_implementation": a} if (a := model_args.attn_implementation) else {}),
    )

    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize(batch):
        texts = [batch["text_a"]] + ([batch["text_b"]] if "text_b" in batch else [])
        encoded = tokenizer(
            *texts, truncation=True, max_length=data_args.max_seq_length, padding=padding
        )
        if data_args.drop_token_type_ids:
            encoded.pop("token_type_ids", None)
        return encoded

    texts = [c for c in ("text_a", "text_b") if c in train.column_names]
    with training_args.main_process_first(desc="tokenizing"):
        train = train.map(tokenize, batched=True, remove_columns=texts)
        dev = dev.map(tokenize, batched=True, remove_columns=texts)

    compute, metric_source = glue_metric(data_args.task_name, num_labels == 1)

    def compute_metrics(prediction):
        logits = prediction.predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        predicted = logits.squeeze(-1) if num_labels == 1 else logits.argmax(-1)
        return compute(predicted, prediction.label_ids)

    stats, callbacks = recipe_callbacks(config, recipe_args)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=dev,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
        callbacks=callbacks,
    )
    checkpoint = resume_checkpoint(recipe_args, training_args, stats)
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    train_seconds = stats.train_seconds()
    metrics = trainer.evaluate()
    if not trainer.is_world_process_zero():
        return None

    spec = TASKS.get(data_args.task_name)
    main_metric = spec.main_metric if spec else ("pearson" if num_labels == 1 else "accuracy")
    record = run_record(trainer, stats, config)
    results = {
        "task": data_args.task_name,
        "recipe": record.pop("recipe"),
        "seed": record.pop("seed"),
        "model": model_args.model_name_or_path,
        "metric": {"name": main_metric, "value": metrics.get(f"eval_{main_metric}")},
        "eval": metrics,
        # Every evaluation during training (--eval_strategy epoch: one per epoch), so that the
        # best epoch, the paper's protocol, can be reported beside the last.
        "eval_history": [
            {"epoch": entry.get("epoch"), "step": entry.get("step"), "value": entry[key]}
            for entry in trainer.state.log_history[:-1]  # the last is the final evaluate()
            if (key := f"eval_{main_metric}") in entry
        ],
        "metric_source": metric_source,
        "train_loss": train_result.training_loss,
        "train_seconds": round(train_seconds, 1),
        **record,
        "training": {
            "learning_rate": training_args.learning_rate,
            "per_device_train_batch_size": training_args.per_device_train_batch_size,
            "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
            "num_train_epochs": training_args.num_train_epochs,
            "max_steps": training_args.max_steps,
            "max_seq_length": data_args.max_seq_length,
            "pad_to_max_length": data_args.pad_to_max_length,
            "drop_token_type_ids": data_args.drop_token_type_ids,
            "warmup_steps": training_args.warmup_steps,
            "weight_decay": training_args.weight_decay,
            "train_examples": len(train),
            "dev_examples": len(dev),
            "world_size": training_args.world_size,
            "precision": "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32",
        },
    }
    path = write_results(training_args.output_dir, results, results_markdown(results))
    logger.info("results in %s: %s", path, results["metric"])
    return results


def results_markdown(r: dict) -> str:
    return (
        f"# {r['task']} / {r['recipe']} / seed {r['seed']}\n\n"
        "| metric | value |\n|---|---|\n"
        + "".join(
            f"| {k} | {v:.4f} |\n" if isinstance(v, float) else f"| {k} | {v} |\n"
            for k, v in r["eval"].items()
        )
        + f"| train loss | {r['train_loss']:.4f} |\n"
        + record_markdown_rows(r)
        + f"| metric source | {r['metric_source']} |\n\n"
        f"Config: `{json.dumps(r['actq'])}`\n"
    )


if __name__ == "__main__":
    main()
