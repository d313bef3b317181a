"""What the recipes (``recipes/glue``, ``recipes/llama_lora``) record of a training run, in one
place: the ``--no_actq``/``--peak_step`` arguments, a callback that times every step and
measures one step's peak memory, and the part of the results file every recipe shares
(activation and peak memory, step time, adaptive calibrations, config, versions), and what the
recipes' sweeps share (a lock per run, the checkout's commit, the README's results section)."""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_actq.config import ActQConfig
from hf_actq.integrations.transformers import unwrap
from hf_actq.memory.meter import ActivationMonitor
from hf_actq.memory.peak import PeakMemory

# StepStats' records beside each checkpoint, for a run resumed from it.
RECORD_FILE = "hf_actq_recipe_record.json"


@dataclass
class RecipeArguments:
    actq: bool = field(
        default=True,
        metadata={"help": "Patch with hf_actq; --no_actq trains the unpatched baseline."},
    )
    peak_step: int = field(
        default=1,
        metadata={
            "help": "The training step whose peak memory is measured (after step 0, the "
            "optimizer state exists and is counted as already live)."
        },
    )
    stop_after_steps: int | None = field(
        default=None,
        metadata={
            "help": "Stop training after this many optimizer steps, keeping the full run's "
            "learning-rate schedule (--max_steps would shorten it): the first steps of a "
            "recorded run, for tools/replay_results.py to compare with its record."
        },
    )
    resume: bool = field(
        default=False,
        metadata={
            "help": "Go on from the last checkpoint in --output_dir when there is one (with "
            "--save_strategy epoch, a run cut short loses at most an epoch); the results "
            "count both parts: step 0's activation memory, the step peak, every step's time "
            "and every calibration."
        },
    )


class StepStats(TrainerCallback):
    """Wall time of every optimizer step, the peak memory of step ``peak_step`` (most bytes live
    at once above what was live when it began: activations, gradients and transients; on CPU
    from the profiler's allocation events, see :mod:`hf_actq.memory.peak`), and, for the
    unpatched baseline, the activation memory of step 0 metered as ``ActQCallback`` meters it."""

    def __init__(self, peak_step: int, meter_activations: bool, stop_after_steps=None):
        self.peak_step = peak_step
        self.stop_after_steps = stop_after_steps
        self.meter_activations = meter_activations
        self.step_seconds: dict[int, float] = {}
        self.peak_bytes: int | None = None
        self.activation_bytes: int | None = None
        self.actq_callback = None  # set by recipe_callbacks: its records go into checkpoints
        # What the run's earlier part recorded, when it resumed from a checkpoint.
        self.resumed_from_step: int | None = None
        self.earlier_calibrations: list[dict] = []
        self.earlier_train_seconds = 0.0
        self._monitor = None
        self._peak = None
        self._began = 0.0
        self._train_began = 0.0
        self._train_ended: float | None = None
        self._step = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._train_began, self._train_ended = time.perf_counter(), None
        if self.meter_activations and model is not None and self.resumed_from_step is None:
            self._monitor = ActivationMonitor(unwrap(model))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._step = state.global_step
        if self._monitor is not None and self._step == 0:
            self._monitor.arm()
        if self._step == self.peak_step:
            self._peak = PeakMemory(args.device)
            self._peak.__enter__()
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds[self._step] = time.perf_counter() - self._began
        if self._peak is not None:
            self._peak.__exit__(None, None, None)
            self.peak_bytes, self._peak = self._peak.peak_bytes, None
        if self._monitor is not None and self._monitor.armed:
            self._monitor.disarm()
            self.activation_bytes = self._monitor.max_bytes
        if self.stop_after_steps is not None and state.global_step >= self.stop_after_steps:
            control.should_training_stop = True  # after this step's log: the loop checks later

    def on_train_end(self, args, state, control, **kwargs):
        self._train_ended = time.perf_counter()
        if self._monitor is not None:
            self._monitor.remove()
            self._monitor = None

    def on_save(self, args, state, control, **kwargs):
        """This run's records so far, beside the checkpoint Trainer just wrote: what a resumed
        run cannot measure again (step 0, the peak step, the earlier steps' times)."""
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir() or not state.is_world_process_zero:
            return
        record = {
            "step_seconds": {str(k): v for k, v in self.step_seconds.items()},
            "peak_bytes": self.peak_bytes,
            "activation_bytes": self.step0_activation_bytes(),
            "calibrations": self.calibrations(),
            "train_seconds": self.train_seconds(),
        }
        (folder / RECORD_FILE).write_text(json.dumps(record) + "\n")

    def restore(self, checkpoint: str) -> None:
        """Take the records the run's earlier part left beside ``checkpoint``."""
        record = json.loads((Path(checkpoint) / RECORD_FILE).read_text())
        self.step_seconds = {int(k): v for k, v in record["step_seconds"].items()}
        self.peak_bytes = record["peak_bytes"]
        self.activation_bytes = record["activation_bytes"]
        self.earlier_calibrations = record["calibrations"]
        self.earlier_train_seconds = record["train_seconds"]
        self.resumed_from_step = int(Path(checkpoint).name.split("-")[-1])

    def step0_activation_bytes(self) -> int | None:
        """Step 0's activation memory: ``ActQCallback``'s figure (its first record is step
        0's), the baseline's own, or the earlier part's after a resume."""
        if self.resumed_from_step is not None or self.actq_callback is None:
            return self.activation_bytes
        history = self.actq_callback.memory_history
        return history[0]["activation_bytes"] if history else None

    def calibrations(self) -> list[dict]:
        """Each adaptive plan's step, size and cost (not its per-slot sensitivities), the
        earlier part's first."""
        callback = self.actq_callback
        found = list(self.earlier_calibrations)
        if callback is None:
            return found
        # After a resume the callback lists every step a plan was made at, but holds the
        # checkpoint's plan and this part's new ones only: pair this part's steps with the
        # plans made in it, the last ones.
        first = self.resumed_from_step or 0  # the earlier part's calibrations came before it
        steps = [at for at in callback.calibrated_at if at >= first]
        plans = callback.plans[-len(steps) :] if steps else []
        for at, plan in zip(steps, plans):  # a failed calibration made no plan: shorter
            info = {k: v for k, v in plan.info.items() if k not in ("sensitivity", "shared")}
            found.append({"step": at, **info})
        return found

    def train_seconds(self) -> float:
        """Training's wall time, the earlier part's included after a resume (the one clock of
        the run's record and of the checkpoints' records)."""
        end = time.perf_counter() if self._train_ended is None else self._train_ended
        return self.earlier_train_seconds + end - self._train_began

    def typical_step_seconds(self) -> float | None:
        """The median step, leaving out step 0 (warm-up, optimizer state) and the profiled one."""
        kept = [s for k, s in self.step_seconds.items() if k not in (0, self.peak_step)]
        kept = kept or list(self.step_seconds.values())
        return statistics.median(kept) if kept else None


def recipe_label(config: ActQConfig | None) -> str:
    """A short name for tables: ``baseline``, ``fewbit-3``, ``uniform-4``, ``alam-1`` (ALAM's
    allocation), ``alam-1-even`` (adaptive off), ``checkpoint-4`` (the layers' inputs' bits), or
    ``custom-...`` for configs made field by field; ``-rotated`` marks ``codec="rotated"``
    (``checkpoint_codec`` for the checkpoint recipe), ``-fewbit-act`` an adaptive plan that
    keeps activations' few-bit codes (``allocate_activations=False``)."""
    if config is None:
        return "baseline"
    bits = f"{config.bits:g}"
    if config.recipe == "fewbit":
        return f"fewbit-{config.activation_bits}"
    if config.recipe == "checkpoint":
        rotated = "-rotated" if config.checkpoint_codec == "rotated" else ""
        return f"checkpoint-{config.checkpoint_bits}{rotated}"
    if config.recipe == "alam" and not config.adaptive and config.plan is None:
        return f"alam-{bits}-even"
    rotated = "-rotated" if config.recipe and config.codec == "rotated" else ""
    fewbit = "" if config.allocate_activations else "-fewbit-act"
    return f"{config.recipe or 'custom-' + config.codec}-{bits}{rotated}{fewbit}"


def run_record(trainer, stats: StepStats, config: ActQConfig | None) -> dict:
    """The fields every recipe's results file holds: loss history, activation bytes of step 0
    (``ActQCallback``'s figure, or ``stats``' own for the baseline), the step peak, the median step
    time, each adaptive plan's size and cost (not its per-slot sensitivities), the config, the
    device and the versions."""
    import transformers

    import hf_actq

    args = trainer.args
    return {
        "recipe": recipe_label(config),
        "seed": args.seed,
        "loss_history": [
            [entry["step"], entry["loss"]] for entry in trainer.state.log_history if "loss" in entry
        ],
        "activation_bytes_step0": stats.step0_activation_bytes(),
        "step_peak_bytes": stats.peak_bytes,
        "step_peak_step": stats.peak_step,
        "step_seconds_median": stats.typical_step_seconds(),
        "steps": trainer.state.global_step,
        **(
            {}
            if stats.resumed_from_step is None
            else {"resumed_from_step": stats.resumed_from_step}
        ),
        "calibrations": stats.calibrations(),
        "actq": config.to_dict() if config is not None else None,
        "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_actq": hf_actq.__version__,
        },
    }


def setup_logging(training_args, *names: str) -> None:
    """Log to stdout at the Trainer's process level; hf_actq's and the recipe's own loggers at
    INFO on the main process, WARNING elsewhere."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=training_args.get_process_log_level(),
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    for name in ("hf_actq", *names):
        logging.getLogger(name).setLevel(
            logging.INFO if training_args.should_log else logging.WARNING
        )


def recipe_callbacks(config: ActQConfig | None, recipe_args: RecipeArguments):
    """``(stats, callbacks)``: the step statistics, and the list for Trainer: ``ActQCallback``
    (none for the baseline, whose activations ``stats`` meters instead) and ``stats``."""
    stats = StepStats(
        recipe_args.peak_step, config is None, stop_after_steps=recipe_args.stop_after_steps
    )
    if config is None:
        return stats, [stats]
    from hf_actq.integrations.trainer import ActQCallback

    stats.actq_callback = ActQCallback(config)
    return stats, [stats.actq_callback, stats]


def resume_checkpoint(recipe_args: RecipeArguments, training_args, stats: StepStats) -> str | None:
    """With ``--resume``, the last checkpoint in ``--output_dir`` (its records restored into
    ``stats``), for ``trainer.train(resume_from_checkpoint=...)``; else None."""
    if not recipe_args.resume or not os.path.isdir(training_args.output_dir):
        return None
    from transformers.trainer_utils import get_last_checkpoint

    checkpoint = get_last_checkpoint(training_args.output_dir)
    if checkpoint is None or not (Path(checkpoint) / RECORD_FILE).exists():
        return None  # none, or one this recipe did not write: train from the start
    stats.restore(checkpoint)
    return checkpoint


def write_results(output_dir: str, results: dict, markdown: str) -> Path:
    """``actq_results.json`` and ``actq_results.md`` in ``output_dir``; the JSON's path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "actq_results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "actq_results.md").write_text(markdown)
    return out / "actq_results.json"


def mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def record_markdown_rows(record: dict) -> str:
    """The memory and timing rows of a results table (``| name | value |``)."""
    seconds = record["step_seconds_median"]
    return (
        f"| activation MiB (step 0) | {mib(record['activation_bytes_step0'])} |\n"
        f"| step peak MiB (step {record['step_peak_step']}) | {mib(record['step_peak_bytes'])} |\n"
        f"| step seconds (median) | {'n/a' if seconds is None else f'{seconds:.3f}'} |\n"
        f"| steps | {record['steps']} |\n| device | {record['device']} |\n"
    )


# Sweeps ----------------------------------------------------------------------------------------
def take_lock(path: Path) -> bool:
    """Take ``path`` as a lock unless a live process holds it (several sweeps may share a grid)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(path.read_text() or 0), 0)
            return False
        except (ProcessLookupError, ValueError):
            path.unlink(missing_ok=True)  # its process died: take it over
            return take_lock(path)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def replace_marked_section(readme: Path, text: str, name: str = "results") -> None:
    """Replace what lies between ``<!-- {name}:start -->`` and ``<!-- {name}:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    content = readme.read_text()
    if start not in content or end not in content:
        return
    head, rest = content.split(start, 1)
    readme.write_text(f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}")
