"""Convergence evidence that runs on a CPU: does a decoder trained under hf_actq learn as well as
one trained exactly? A small LLaMA is built from config and pretrained on the Alpaca data, then
fine-tuned from that checkpoint with LoRA and with full fine-tuning under each recipe and seed,
every stage through ``run.py``; the held-out losses go into a table and the loss curves into a
plot, both in this directory's README.

    python recipes/llama_lora/convergence.py                 # every stage; resumable
    python recipes/llama_lora/convergence.py --render-only   # table and plot from results/
    python recipes/llama_lora/convergence.py --modes lora --recipes baseline fewbit-3 --seeds 0

Stages (each skipped when its result file exists; several drivers may share the grid, a run in
progress holds a lock):

1. ``init``: a byte-level BPE tokenizer of 4,096 tokens trained on the training split of the
   data (the held-out split is never seen), and a LLaMA with random weights (4 layers, hidden 256,
   4 heads, 2 key-value heads, SiLU MLP 688 wide, tied embeddings: 3.95 M parameters).
2. ``pretrain``: every weight, unpatched, the loss on every token (prompt and response), on the
   first half of the training split (2,375 examples), packed into blocks of 256 tokens, batch
   16, AdamW lr 1e-3 with cosine decay, 1 epoch (left short of convergence, so that
   fine-tuning on new examples has something to learn); saved.
3. ``finetune``: from the pretrained model, on the second half of the training split (examples
   it has never seen), the loss on response tokens only (the recipe's default), packed, batch
   16, 100 steps, lr 2e-3 for LoRA (rank 16 on every linear layer) and 5e-4 for full
   fine-tuning, held-out loss every 20 steps; for each mode, recipe and seed. A seed fixes the
   data order, LoRA's initialisation and the recipes' rounding noise, the same for every recipe
   at that seed. Pretraining runs with ``OMP_NUM_THREADS=1`` and reproduces its held-out losses
   to float rounding, not always to the bit (a rerun here had another weights hash, with logged
   losses up to 4e-7 relative apart).

Results: ``results/convergence/pretrain.json`` and ``results/convergence/<mode>/<recipe>_seed<k>
.json`` (``run.py``'s ``actq_results.json`` with the command, the commit and the SHA-256 of the
checkpoint it started from); scratch outputs and checkpoints under ``runs/convergence``. A
pretraining rerun in a fresh checkout is checked against the committed record: the same
checkpoint hash, or a training that tracks the recorded one to float rounding (every logged
train and held-out loss within 1e-5 relative); anything else stops the grid, so fine-tunes from
different sessions start from the same weights up to rounding, and each records the hash of
the weights it started from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/: common/ is shared

from common.records import replace_marked_section, take_lock
from hf_actq.report.provenance import checkout_commit

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "alpaca" / "alpaca_5000.json"

VOCAB_SIZE = 4096
MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=688,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
COMMON = [
    "--max_seq_length", "256", "--packing", "--validation_split_percentage", "5",
    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32",
    "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
]  # fmt: skip
# The training split's first half pretrains the model; fine-tuning sees only the second half,
# examples the model has never been trained on (the held-out split is used by neither).
PRETRAIN_EXAMPLES = "2375"
PRETRAIN = [
    "--no_use_lora", "--no_actq", "--train_on_prompt", "--save_model", "--seed", "0",
    "--max_train_samples", PRETRAIN_EXAMPLES,
    "--num_train_epochs", "1", "--learning_rate", "1e-3", "--lr_scheduler_type", "cosine",
    "--warmup_steps", "20", "--weight_decay", "0.1", "--logging_steps", "10",
    "--eval_strategy", "steps", "--eval_steps", "25",
]  # fmt: skip
FINETUNE = [
    "--skip_train_samples", PRETRAIN_EXAMPLES, "--max_steps", "100",
    "--lr_scheduler_type", "linear", "--warmup_steps", "10",
    "--logging_steps", "5", "--eval_strategy", "steps", "--eval_steps", "20",
]  # fmt: skip
MODES = {
    "lora": ["--learning_rate", "2e-3", "--lora_r", "16", "--lora_alpha", "32"],
    "full": ["--no_use_lora", "--learning_rate", "5e-4"],
}
RECIPES = {
    "baseline": ["--no_actq"],
    "fewbit-3": ["--recipe", "fewbit", "--bits", "3"],
    "uniform-4": ["--recipe", "uniform", "--bits", "4"],
    "uniform-3": ["--recipe", "uniform", "--bits", "3"],  # ActQCallback(bits=3)
    # Our allocator at 1 bit on 8 examples: what "alam" was when these ran, retired since
    # (hf_actq/config.py, RETIRED_FIELDS): its results stay in the table; it runs no more.
    "alam-1-gradvar": None,
    # Unrotated: the recipe's codec when these runs were made (rotation is its default now).
    "checkpoint-4": ["--recipe", "checkpoint", "--bits", "4", "--checkpoint_codec", "uniform"],
}
COLOURS = {
    "baseline": "black",
    "fewbit-3": "tab:blue",
    "uniform-4": "tab:green",
    "uniform-3": "tab:olive",
    "alam-1-gradvar": "tab:red",
    "checkpoint-4": "tab:purple",
}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_recipe_module():
    """``run.py`` itself, so the tokenizer is trained on exactly the split it trains on."""
    sys.path.insert(0, str(HERE))
    import run as recipe

    return recipe


# Stage 1 ---------------------------------------------------------------------------------------
def build_init(data_path: str, out: Path) -> None:
    """The tokenizer (trained on the training split only) and the random-weight model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    recipe = load_recipe_module()
    records = recipe.load_records(data_path).shuffle(seed=0)  # run.py's split, exactly
    held_out = max(1, int(len(records) * 5.0 / 100))
    train = records.train_test_split(test_size=held_out, shuffle=False)["train"]
    texts = (
        recipe.prompt_of(r["instruction"], r["input"]) + r["output"] for r in train
    )  # the text the model will see, without special tokens
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL,
    )
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


# Stages 2 and 3 --------------------------------------------------------------------------------
def run_stage(command: list[str], workdir: Path, target: Path, extra: dict) -> bool:
    """Run ``command`` (a run.py invocation writing into ``workdir``) unless ``target`` exists
    or another driver holds the run; copy its results to ``target`` with provenance."""
    workdir.mkdir(parents=True, exist_ok=True)
    lock = workdir / "lock"
    if target.exists() or not take_lock(lock):
        return False
    try:
        print(f"running {workdir.name}: log in {workdir}/log.txt", flush=True)
        commit = checkout_commit(REPO)  # the code the run starts with, not the one it ends on
        with open(workdir / "log.txt", "w") as log:
            code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
        if code != 0:
            print(f"{target.name} failed (exit {code}); see {workdir}/log.txt", flush=True)
            return False
        result = json.loads((workdir / "actq_results.json").read_text())
        result.update(extra, command=shlex.join(command), commit=commit)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=1) + "\n")
        return True
    finally:
        lock.unlink(missing_ok=True)


# How far apart (relative) a rerun's logged losses may be from the recorded pretraining's.
REPRODUCED = 1e-5


def trajectory_drift(recorded: dict, rerun: dict) -> float:
    """Largest relative difference between two pretraining runs' logged losses (train loss
    history, held-out history, final train loss); inf when they logged different steps."""
    pairs = [(recorded["train_loss"], rerun["train_loss"])]
    for key in ("loss_history", "eval_history"):
        if [step for step, _ in recorded[key]] != [step for step, _ in rerun[key]]:
            return float("inf")
        pairs += [(a, b) for (_, a), (_, b) in zip(recorded[key], rerun[key], strict=True)]
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)


def pretrained_model(args) -> Path:
    """The pretrained checkpoint: trained here if missing, and checked against the committed
    hash when a result file already records one."""
    runs, results = Path(args.runs), Path(args.results)
    init, workdir = runs / "init", runs / "pretrain"
    model = workdir / "model"
    record = results / "pretrain.json"
    if (model / "model.safetensors").exists() and not record.exists():
        return model  # another driver's pretraining just finished; its result follows
    if not (model / "model.safetensors").exists():
        if not (init / "model.safetensors").exists():
            build_init(args.data, init)
        command = [sys.executable, str(HERE / "run.py"), "--model_name_or_path", str(init)]
        command += ["--data_path", args.data, "--output_dir", str(workdir), *COMMON, *PRETRAIN]
        previous = json.loads(record.read_text()) if record.exists() else None
        record_tmp = runs / "pretrain.json"
        record_tmp.unlink(missing_ok=True)
        run_stage(command, workdir, record_tmp, {"stage": "pretrain"})
        if not record_tmp.exists():
            sys.exit("pretraining failed")
        fresh = json.loads(record_tmp.read_text())
        fresh["checkpoint_sha256"] = sha256(model / "model.safetensors")
        if previous and previous["checkpoint_sha256"] != fresh["checkpoint_sha256"]:
            drift = trajectory_drift(previous, fresh)
            if drift > REPRODUCED:
                sys.exit(
                    f"the pretrained checkpoint differs from the committed one ({record}) by "
                    f"more than rounding (losses {drift:.1e} apart, relative): the fine-tunes "
                    "already recorded started from other weights. Rerun where they were made, "
                    "or move results/convergence aside to start the comparison over."
                )
            print(
                f"pretraining reproduced the recorded one to rounding (losses {drift:.1e} apart, "
                "relative) with another hash; fine-tunes record the hash they start from"
            )
        if previous is None:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(fresh, indent=1) + "\n")
    return model


def grid(modes, recipes, seeds) -> list[tuple[str, str, int]]:
    """Seeds outermost, so a partial grid has every row at one seed first."""
    return [(mode, recipe, seed) for seed in seeds for mode in modes for recipe in recipes]


# Rendering -------------------------------------------------------------------------------------
def _mean_std(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) < 2 else f"{mean:.3f} ± {statistics.stdev(values):.3f}"


def _ratio(runs: list[dict], baseline: dict[int, dict], key: str, inverse: bool = False) -> str:
    """The mean over seeds of run / baseline at the same seed (baseline / run with
    ``inverse``: a compression ratio, averaged before rounding)."""
    ratios = [
        (baseline[r["seed"]][key] / r[key]) if inverse else (r[key] / baseline[r["seed"]][key])
        for r in runs
        if r["seed"] in baseline and r.get(key) and baseline[r["seed"]].get(key)
    ]
    if not ratios:
        return ""
    return f"{statistics.fmean(ratios):.1f}x" if inverse else f"{statistics.fmean(ratios):.2f}x"


def _last_train_loss(record: dict) -> float:
    """The last logged training loss (the run's mean when nothing was logged)."""
    history = record["loss_history"]
    return history[-1][1] if history else record["train_loss"]


def render(results: Path) -> str:
    lines = []
    pretrain = results / "pretrain.json"
    if pretrain.exists():
        p = json.loads(pretrain.read_text())
        lines.append(
            f"Pretraining: {p['steps']} steps ({p['training']['train_examples']} packed blocks "
            f"of 256 tokens, {p['training']['num_train_epochs']:g} epoch(s)), final held-out loss "
            f"on every token {p['eval_loss']:.3f} (perplexity "
            f"{p['eval_perplexity']:.1f}), {p['train_seconds'] / 60:.0f} min on {p['device']}.\n"
        )
    for mode in MODES:
        runs = [json.loads(f.read_text()) for f in sorted((results / mode).glob("*.json"))]
        if not runs:
            continue
        baseline = {r["seed"]: r for r in runs if r["sweep_recipe"] == "baseline"}
        base_loss = [r["eval_loss"] for r in baseline.values()]
        lines += [
            f"\n**{'LoRA (rank 16, every linear layer)' if mode == 'lora' else 'Full fine-tuning'}**"
            " (held-out loss on response tokens)\n",
            "| recipe | seeds | final held-out loss | Δ vs baseline | final train loss | "
            "activation compression | step peak vs baseline | step time vs baseline |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for recipe in RECIPES:
            rows = [r for r in runs if r["sweep_recipe"] == recipe]
            if not rows:
                continue
            losses = [r["eval_loss"] for r in rows]
            delta = statistics.fmean(losses) - statistics.fmean(base_loss) if base_loss else None
            compression = _ratio(rows, baseline, "activation_bytes_step0", inverse=True)
            lines.append(
                f"| {recipe} | {len(rows)} | {_mean_std(losses)} | "
                f"{'' if delta is None else f'{delta:+.3f}'} | "
                f"{_mean_std([_last_train_loss(r) for r in rows])} | {compression} | "
                f"{_ratio(rows, baseline, 'step_peak_bytes')} | "
                f"{_ratio(rows, baseline, 'step_seconds_median')} |"
            )
    return "\n".join(lines).strip() + "\n"


def plot(results: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any((results / m).glob("*.json"))]
    if not modes:
        return
    figure, axes = plt.subplots(len(modes), 2, figsize=(10, 3.4 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        for file in sorted((results / mode).glob("*.json")):
            r = json.loads(file.read_text())
            colour = COLOURS[r["sweep_recipe"]]
            label = f"{r['sweep_recipe']} seed {r['seed']}"
            style = "-" if r["seed"] == 0 else "--"
            for axis, key in zip(row, ("loss_history", "eval_history")):
                if not r[key]:
                    continue
                steps, losses = zip(*r[key])
                axis.plot(steps, losses, style, color=colour, label=label, lw=1.2, alpha=0.85)
        row[0].set_title(f"{mode}: train loss")
        row[1].set_title(f"{mode}: held-out loss")
        for axis in row:
            axis.set_xlabel("step")
            axis.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="the Alpaca-format file")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    runnable = [recipe for recipe, arguments in RECIPES.items() if arguments is not None]
    parser.add_argument("--recipes", nargs="+", default=runnable, choices=runnable)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--results", default=str(HERE / "results" / "convergence"))
    parser.add_argument("--runs", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="tiny stages for a smoke test (not for results)"
    )
    args = parser.parse_args(argv)
    results = Path(args.results)
    if args.quick:  # a few steps of everything, to check the pipeline end to end
        global MODEL, PRETRAIN, FINETUNE
        MODEL = {**MODEL, "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}
        PRETRAIN = [*PRETRAIN, "--max_steps", "2"]
        FINETUNE = [*FINETUNE, "--max_steps", "2", "--eval_steps", "1", "--logging_steps", "1"]
    if not args.render_only:
        if not Path(args.data).exists():
            sys.exit(f"no data at {args.data} (give --data)")
        model = pretrained_model(args)
        start = sha256(model / "model.safetensors")
        for mode, recipe, seed in grid(args.modes, args.recipes, args.seeds):
            command = [sys.executable, str(HERE / "run.py"), "--model_name_or_path", str(model)]
            command += ["--data_path", args.data, "--seed", str(seed), *COMMON, *FINETUNE]
            workdir = Path(args.runs) / mode / f"{recipe}_seed{seed}"
            command += ["--output_dir", str(workdir), *MODES[mode], *RECIPES[recipe]]
            target = results / mode / f"{recipe}_seed{seed}.json"
            extra = {"stage": "finetune", "sweep_recipe": recipe, "mode": mode}
            run_stage(command, workdir, target, {**extra, "checkpoint_sha256": start})
    table = render(results)
    (results / "table.md").write_text(table)
    plot(results, results / "curves.png")
    if results.resolve() == (HERE / "results" / "convergence").resolve():
        replace_marked_section(HERE / "README.md", table, "convergence")
    print(table)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
