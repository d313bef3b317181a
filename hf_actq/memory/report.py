"""Memory reports: one training step of a model per recipe, measured side by side.

For each recipe (the unpatched baseline first) :func:`measure_model` builds the architecture from
its config with random weights, optionally wraps it in PEFT LoRA/QLoRA, applies hf_actq, and runs
one forward, backward and AdamW step, measuring:

- activation memory: the bytes autograd holds for backward after the forward pass
  (:class:`SavedTensorMeter`, by storage, parameters excluded, packed buffers, scales, masks and
  tables all included), per op kind, and again by walking the autograd graph
  (:func:`graph_saved_bytes`) as an independent check;
- model state: parameters and buffers, gradients and optimizer state, from the tensors themselves;
- peak memory of the step (:class:`PeakMemory`: allocator events on CPU, CUDA's counters on GPU)
  plus the memory live when the step began.

The peak is measured per phase of the step (forward, the head's backward, the layers', the
embeddings', the optimizer step), and the report says in which phase it falls.

Models too large for this machine are measured with 1 and 2 layers and every figure is
extrapolated linearly to the full depth (layers are identical, so the per-layer difference is
exact for activations and model state), and the report says so. The peak is an estimate: each
phase's peak is extrapolated on its own and the largest taken, because the phase holding the
peak can change with depth (a large vocabulary's head backward at 1 and 2 layers, the optimizer
step at 26), where extrapolating the step's peak itself would follow the wrong phase's slope. The
largest batch that fits a GPU follows the few-bit paper's App. B:
``floor((gpu_memory - model_state) / activation_per_sample)``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from hf_actq.config import ActQConfig
from hf_actq.memory.meter import OP_KINDS, SavedTensorMeter, _storage_key, graph_saved_bytes
from hf_actq.memory.peak import PeakMemory

PEFT_MODES = ("none", "lora", "qlora")
TASKS = ("causal-lm", "classification", "seq2seq-lm")
_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta-v2"}
_FIGURES = (
    "activation_bytes",
    "graph_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "peak_bytes",
)


@dataclass
class Measurement:
    """One training step: bytes, all measured (or, with ``scaled``, extrapolated from two)."""

    activation_bytes: int
    graph_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    by_kind: dict[str, int] = field(default_factory=dict)
    peak_by_phase: dict[str, int] = field(default_factory=dict)  # model state included

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def peak_phase(self) -> str | None:
        """The phase of the step whose peak is the step's."""
        if not self.peak_by_phase:
            return None
        return max(self.peak_by_phase, key=self.peak_by_phase.__getitem__)


@dataclass
class RecipeResult:
    label: str
    config: dict | None  # ActQConfig.to_dict(), None for the baseline
    measurement: Measurement
    patched_modules: int = 0
    plan: dict | None = None  # BitPlan.to_dict() of an adaptive recipe
    slot_kinds: dict[str, str] = field(default_factory=dict)


@dataclass
class MemoryReport:
    model: str
    model_type: str
    num_layers: int
    measured_layers: list[int]  # [num_layers] when whole, [1, 2] when extrapolated
    batch_size: int
    seq_len: int
    dtype: str
    peft: str
    task: str
    device: str
    gpu_memory_bytes: int
    results: list[RecipeResult]
    note: str = ""  # what the measurement leaves out, said under the heading

    @property
    def scaled(self) -> bool:
        return self.measured_layers != [self.num_layers]

    def rows(self) -> list[dict]:
        """The table: one row per recipe, in bytes and ratios against the first (baseline)."""
        base = self.results[0].measurement
        rows = []
        for result in self.results:
            m = result.measurement
            per_sample = m.activation_bytes / self.batch_size
            if (result.config or {}).get("checkpoint_bits") is not None:
                # Checkpointed layers are recomputed one at a time in backward, and each keeps
                # its activations until its backward is done: about one stock layer's worth
                # (the baseline's per layer; less when compress_checkpointed) on top.
                per_sample += base.activation_bytes / self.num_layers / self.batch_size
            room = self.gpu_memory_bytes - m.model_state_bytes
            rows.append(
                {
                    "recipe": result.label,
                    "activation_bytes": m.activation_bytes,
                    "independent_count_bytes": m.graph_bytes,
                    "compression": base.activation_bytes / max(m.activation_bytes, 1),
                    "activation_saved": 1 - m.activation_bytes / max(base.activation_bytes, 1),
                    "model_state_bytes": m.model_state_bytes,
                    "peak_bytes": m.peak_bytes,
                    "peak_phase": m.peak_phase,
                    "max_batch_size": max(0, math.floor(room / per_sample)) if per_sample else 0,
                    "by_kind": m.by_kind,
                    "patched_modules": result.patched_modules,
                }
            )
        return rows

    def to_dict(self) -> dict:
        data = asdict(self)
        data["scaled"] = self.scaled
        data["rows"] = self.rows()
        return data

    def to_markdown(self) -> str:
        gib = 2**30
        lines = [
            f"**{self.model}** ({self.model_type}, {self.num_layers} layers), batch {self.batch_size},"
            f" sequence {self.seq_len}, {self.dtype}, PEFT: {self.peft}, device: {self.device}.",
            "",
        ]
        if self.note:
            lines += [self.note, ""]
        if self.scaled:
            lines += [
                f"Measured with {' and '.join(map(str, self.measured_layers))} layers and "
                f"extrapolated linearly to {self.num_layers} (activations and model state are "
                "exact per layer; the peak is an estimate, the largest of each phase's peak "
                "extrapolated on its own).",
                "",
            ]
        peak_label = "peak (estimated)" if self.scaled else "peak (measured)"
        gpu = self.gpu_memory_bytes / gib
        lines += [
            f"| recipe | activation memory | compression | saved | model state | {peak_label} "
            f"| max batch on {gpu:g} GiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        base_batch = base_peak = None
        above = []
        for row in self.rows():
            batch = row["max_batch_size"]
            base_batch = batch if base_batch is None else base_batch
            base_peak = row["peak_bytes"] if base_peak is None else base_peak
            gain = f" ({100 * (batch / base_batch - 1):+.0f}%)" if base_batch else ""
            # What runs out of memory is the peak: a recipe that raises it is flagged.
            flag = " **above baseline**" if row["peak_bytes"] > base_peak * 1.001 else ""
            if flag:
                above.append(row["recipe"])
            phase = f" ({row['peak_phase']})" if row["peak_phase"] else ""
            lines.append(
                f"| {row['recipe']} | {_fmt(row['activation_bytes'])} | "
                f"{row['compression']:.2f}x | {100 * row['activation_saved']:.1f}% | "
                f"{_fmt(row['model_state_bytes'])} | {_fmt(row['peak_bytes'])}{phase}{flag} | "
                f"{batch}{gain} |"
            )
        if above:
            lines += [
                "",
                f"Warning: the step peak of {', '.join(above)} is above the baseline's: fewer "
                "bytes kept for backward, yet more memory needed at the step's worst moment.",
            ]
        kinds = [k for k in OP_KINDS if any(r.measurement.by_kind.get(k) for r in self.results)]
        lines += [
            "",
            "Activation memory by op kind (the module that saved the tensor):",
            "",
            "| recipe | " + " | ".join(kinds) + " |",
            "|---|" + "---:|" * len(kinds),
        ]
        for result in self.results:
            cells = [_fmt(result.measurement.by_kind.get(kind, 0)) for kind in kinds]
            lines.append(f"| {result.label} | " + " | ".join(cells) + " |")
        for result in self.results:
            if result.plan is not None:
                lines += ["", *_plan_markdown(result)]
        return "\n".join(lines) + "\n"

    def write(self, directory: str) -> list[str]:
        """Writes memory.json, memory.md and memory.png (when matplotlib is installed)."""
        import json

        os.makedirs(directory, exist_ok=True)
        paths = [os.path.join(directory, "memory.json"), os.path.join(directory, "memory.md")]
        with open(paths[0], "w") as file:
            json.dump(self.to_dict(), file, indent=2, default=str)
        with open(paths[1], "w") as file:
            file.write(self.to_markdown())
        png = os.path.join(directory, "memory.png")
        if plot(self, png):
            paths.append(png)
        for result in self.results:
            if result.plan is None:
                continue
            name = result.label.replace(":", "_").replace(",", "_").replace("=", "")
            paths.append(os.path.join(directory, f"plan_{name}.json"))
            with open(paths[-1], "w") as file:
                json.dump(result.plan, file, indent=1, sort_keys=True)
            chart = os.path.join(directory, f"bits_{name}.png")
            if plot_plan(result, chart):
                paths.append(chart)
        return paths


def plot(report: MemoryReport, path: str) -> bool:
    """Stacked bars of activation memory by op kind, and peak memory, per recipe."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("memory.png skipped: matplotlib is not installed (pip install matplotlib)")
        return False
    mib = 2**20
    labels = [r.label for r in report.results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(labels)
    for kind in OP_KINDS:
        heights = [r.measurement.by_kind.get(kind, 0) / mib for r in report.results]
        if any(heights):
            left.bar(labels, heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
    left.set_ylabel("MiB")
    left.set_title("activation memory (saved for backward)")
    left.legend(fontsize=8)
    state = [r.measurement.model_state_bytes / mib for r in report.results]
    peaks = [r.measurement.peak_bytes / mib for r in report.results]
    right.bar(labels, peaks, color="tab:gray", label="peak" + (" (est.)" if report.scaled else ""))
    right.bar(labels, state, color="tab:blue", label="model state")
    right.set_title("peak memory of a training step")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20, labelsize=8)
    figure.suptitle(
        f"{report.model}: batch {report.batch_size}, seq {report.seq_len}, {report.dtype}, "
        f"PEFT {report.peft}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _plan_markdown(result: RecipeResult) -> list[str]:
    from hf_actq.adaptive.plan import BitPlan

    plan = BitPlan.from_dict(result.plan)
    info = plan.info
    examples = info.get("examples", "?")
    # ALAM's accounting, then ours.
    amount = (
        f"ALAM's accounting (code bits over {info['elements']:,} elements, no scales): "
        f"{info['alam_bits']:.3f} bits, {info['bytes']:,} of {info['budget_bytes']:,} code "
        f"bytes; counted with scales and minima, {info['counted_bytes']:,} bytes"
    )
    lines = [
        f"Bit plan of {result.label}: {plan.target_bits} bits on average {amount} "
        f"(the even spread keeps {info['even_bytes']:,}); {info['measured']} slots measured "
        f"on {examples} example{'' if examples == 1 else 's'}, {info['estimated']} estimated, "
        f"{info['seconds']:.1f} s"
        + (" (on the measured model, before extrapolation)." if info.get("scaled") else "."),
        "",
        "| slot kind | settings (slots) |",
        "|---|---|",
    ]
    for kind, counts in sorted(plan.summary(result.slot_kinds).items()):
        cells = ", ".join(f"{label} ({n})" for label, n in sorted(counts.items()))
        lines.append(f"| {kind} | {cells} |")
    return lines


def bits_by_layer(plan: dict, kinds: dict[str, str]) -> dict[str, dict[int, float]]:
    """Average bits per element of each slot kind in each layer (the first number in a slot's
    module path), from a plan's settings."""
    import re

    totals: dict[str, dict[int, list[float]]] = {}
    for slot, setting in plan["slots"].items():
        layer = re.search(r"\.(\d+)(\.|:)", slot)
        if layer is None or setting.get("codec") == "exact":
            continue
        per_layer = totals.setdefault(kinds.get(slot, "other"), {})
        per_layer.setdefault(int(layer.group(1)), []).append(float(setting["bits"]))
    return {
        kind: {layer: sum(v) / len(v) for layer, v in sorted(layers.items())}
        for kind, layers in totals.items()
    }


def plot_plan(result: RecipeResult, path: str) -> bool:
    """Bits per layer and slot kind of an adaptive plan (as ALAM's Fig. 6)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = bits_by_layer(result.plan, result.slot_kinds)
    if not series:
        return False
    figure, axis = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(series)
    for i, (kind, layers) in enumerate(sorted(series.items())):
        xs = [layer + (i - (len(series) - 1) / 2) * width for layer in layers]
        axis.bar(xs, list(layers.values()), width=width, label=kind)
    axis.set_xticks(sorted({layer for layers in series.values() for layer in layers}))
    axis.set_xlabel("layer")
    axis.set_ylabel("bits per element")
    axis.set_yscale("log", base=2)
    axis.set_title(f"{result.label}: bits by layer and slot kind")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _fmt(nbytes: float) -> str:
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


# Measuring -------------------------------------------------------------------------------------


CHUNKED_LOSS = "chunked-loss"  # the stock model but for the causal-LM loss


def parse_recipe(spec: str) -> tuple[str, ActQConfig | None]:
    """ "baseline", "chunked-loss", "fewbit", "uniform:bits=4", "alam:bits=0.5,dropout_mode=mask"
    -> config."""
    name, _, overrides = spec.partition(":")
    if name in ("baseline", CHUNKED_LOSS):
        if overrides:
            raise ValueError(f"the {name} recipe takes no overrides")
        if name == CHUNKED_LOSS:
            off = ("activations", "linear", "norm", "gated_mlp", "attention", "dropout")
            return spec, ActQConfig(**dict.fromkeys(off, False), share_norm_outputs=False)
        return spec, None
    values = {}
    for item in filter(None, overrides.split(",")):
        key, equals, text = item.partition("=")
        if not equals:
            raise ValueError(f"recipe override {item!r} in {spec!r} must look like key=value")
        values[key.strip()] = _parse_value(text.strip())
    return spec, ActQConfig.from_recipe(name, **values)


def _parse_value(text: str):
    if text in ("True", "true", "False", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def default_task(config) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    return "classification" if config.model_type in _ENCODER_TYPES else "causal-lm"


def measure_model(
    config,
    recipes: list[str],
    *,
    name: str | None = None,
    batch_size: int = 8,
    seq_len: int = 128,
    dtype: torch.dtype = torch.float32,
    peft: str = "none",
    task: str | None = None,
    layers: str = "auto",
    gpu_memory_bytes: int = 80 * 2**30,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    calibration_examples: int = 2,
    calibration_seconds: float = 30.0,
    progress: Callable[[str, int], None] | None = None,
) -> MemoryReport:
    """Measures ``config``'s architecture under each recipe; see the module docstring.

    ``progress(what, total)`` is called before each of the ``total`` measured steps.

    ``layers``: "all" builds every layer, "scaled" measures 1 and 2 layers and extrapolates,
    "auto" picks "all" when four copies of the parameters (weights, gradients, two Adam moments)
    take under a quarter of the available RAM (or GPU memory).

    Adaptive recipes ("alam") calibrate their bit plan on ``calibration_examples`` examples of
    the step's batch, for at most ``calibration_seconds``, before the step is measured; the plan
    is part of the result.
    """
    if peft not in PEFT_MODES:
        raise ValueError(f"peft must be one of {', '.join(PEFT_MODES)}, got {peft!r}")
    task = task or default_task(config)
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if layers not in ("auto", "all", "scaled"):
        raise ValueError(f"layers must be 'auto', 'all' or 'scaled', got {layers!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch size and sequence length must be >= 1, got {batch_size}, {seq_len}"
        )
    limit = _max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {limit} positions {config.model_type} supports"
        )
    parsed = [("baseline", None)]
    parsed += [item for item in map(parse_recipe, recipes) if item[1] is not None]
    device = torch.device(device)
    num_layers = _text_config(config).num_hidden_layers
    if layers == "auto":
        layers = "all" if _fits(config, task, dtype, device) else "scaled"
    if _decoder_layers(config) not in (None, num_layers):
        layers = "all"  # scaling one depth for both stacks would misstate the decoder
    measured_layers = [num_layers] if layers == "all" or num_layers <= 2 else [1, 2]

    results = []
    total_steps = len(parsed) * len(measured_layers)
    setup = (batch_size, seq_len, dtype, peft, task, device, attn_implementation)
    budget = (calibration_examples, calibration_seconds)
    for label, actq_config in parsed:
        runs = []
        plan_from = None
        # Deepest first: an adaptive plan is calibrated there once and the shallower model
        # takes it restricted to its own slots. Two plans of their own would spend the same
        # average differently, and extrapolating their difference to the full depth has no
        # plan behind it (LLaMA2-7B LoRA at micro-batch 1 came out above the even spread).
        for depth in reversed(measured_layers):
            if progress:
                progress(f"{label}, {depth} layer{'s' * (depth > 1)}", total_steps)
            step = _measure_step(config, actq_config, depth, *setup, budget, plan_from)
            runs.insert(0, step)
            plan_from = runs[0][2]
        measurement = runs[0][0]
        if len(runs) == 2:
            measurement = _extrapolate(runs[0][0], runs[1][0], num_layers)
        as_dict = actq_config.to_dict() if actq_config is not None else None
        _, patched, plan, kinds = runs[-1]
        if plan is not None:
            plan["info"]["scaled"] = len(runs) == 2
        results.append(RecipeResult(label, as_dict, measurement, patched, plan, kinds))
    return MemoryReport(
        model=name or config.model_type,
        model_type=config.model_type,
        num_layers=num_layers,
        measured_layers=measured_layers,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=str(dtype).removeprefix("torch."),
        peft=peft,
        task=task,
        device=str(device),
        gpu_memory_bytes=gpu_memory_bytes,
        results=results,
        note=(
            "A vision-language model, measured on text alone: its vision tower's weights are in "
            "the model state, its activations (images) are not measured."
            if _is_vision_language(config)
            else ""
        ),
    )


def _max_positions(config) -> int | None:
    limit = getattr(_text_config(config), "max_position_embeddings", None)
    if limit is not None and config.model_type in ("roberta", "xlm-roberta"):
        limit -= config.pad_token_id + 1  # RoBERTa's positions start after the padding index
    return limit


def _extrapolate(one: Measurement, two: Measurement, num_layers: int) -> Measurement:
    def scale(a, b):
        return a + (num_layers - 1) * (b - a)

    figures = {name: scale(getattr(one, name), getattr(two, name)) for name in _FIGURES}
    kinds = set(one.by_kind) | set(two.by_kind)
    by_kind = {k: scale(one.by_kind.get(k, 0), two.by_kind.get(k, 0)) for k in kinds}
    by_phase = {}
    if one.peak_by_phase and one.peak_by_phase.keys() == two.peak_by_phase.keys():
        # Each phase grows at its own rate; the step's peak is the largest at full depth. (Phases
        # marked at one depth only leave the step's peak extrapolated as it is.)
        by_phase = {p: scale(one.peak_by_phase[p], two.peak_by_phase[p]) for p in two.peak_by_phase}
        figures["peak_bytes"] = max(by_phase.values())
    return Measurement(**figures, by_kind=by_kind, peak_by_phase=by_phase)


def _fits(config, task, dtype, device) -> bool:
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
    if task == "causal-lm" and _is_vision_language(config):
        name = "AutoModelForImageTextToText"  # LLaVA and Qwen-VL have no causal-LM auto class
    return getattr(transformers, name)


def _text_config(config):
    """The config that holds the language model's depth, vocabulary and positions: a
    vision-language model's ``text_config``, any other model's own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _is_vision_language(config) -> bool:
    return not getattr(config, "is_encoder_decoder", False) and _text_config(config) is not config


# Where encoder-decoder configs keep their decoder's depth (T5, BART).
_DECODER_DEPTH = ("num_decoder_layers", "decoder_layers")


def _decoder_layers(config) -> int | None:
    if not getattr(config, "is_encoder_decoder", False):
        return None
    return next((getattr(config, n) for n in _DECODER_DEPTH if hasattr(config, n)), None)


def build_model(config, num_layers, dtype, peft, task, device, attn_implementation=None):
    """The architecture with ``num_layers`` layers (in each stack of an encoder-decoder) and
    random weights (seed 0), PEFT-wrapped."""
    config = copy.deepcopy(config)
    text = _text_config(config)
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
    return peft_lib.get_peft_model(model, lora)


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


def _measure_step(
    config,
    actq_config,
    num_layers,
    batch_size,
    seq_len,
    dtype,
    peft,
    task,
    device,
    attn,
    budget,
    plan_from=None,
) -> tuple[Measurement, int, dict | None, dict]:
    """One step's measurement, the number of patched modules, and for an adaptive recipe the
    plan it calibrated on the step's inputs (and the slots' kinds). ``plan_from``: a deeper
    model's plan (a dict), whose settings for this model's slots are used instead."""
    model = build_model(config, num_layers, dtype, peft, task, device, attn)
    model.train()
    inputs = _inputs(model.config, task, batch_size, seq_len, device)
    patched, plan, kinds = 0, None, {}
    if actq_config is not None:
        from hf_actq.integrations.transformers import apply

        adaptive = actq_config.adaptive and actq_config.plan is None
        with _quiet(adaptive):  # the plan is calibrated right here
            handle = apply(model, actq_config)
        if adaptive and plan_from is not None:
            from hf_actq.adaptive.plan import BitPlan

            own = {slot: plan_from["slots"][slot] for slot in handle.slots}
            handle.revert()
            handle = apply(model, replace(actq_config, plan=BitPlan(own, plan_from["target_bits"])))
            adaptive = False
        patched, kinds = len(handle.patched), dict(handle.slots)
        if adaptive:
            examples, seconds = budget
            examples = min(examples, actq_config.calibration_examples)  # ALAM's own: one
            plan = handle.calibrate(inputs, examples=examples, seconds=seconds).to_dict()
            plan["info"]["examples"] = min(examples, batch_size)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    _create_optimizer_state(optimizer, trainable)
    model_bytes = _distinct_bytes(_model_tensors(model))
    optimizer_bytes = _distinct_bytes(_optimizer_tensors(optimizer))

    with PeakMemory(device, phase="forward") as peak, _layer_phase_marks(model, peak):
        with SavedTensorMeter(exclude=params, model=model) as meter:
            loss = model(**inputs).loss
        graph_bytes = graph_saved_bytes(loss, exclude=params)
        peak.mark("head backward")
        loss.backward()
        grad_bytes = _distinct_bytes(p.grad for p in trainable if p.grad is not None)
        peak.mark("optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state_bytes = model_bytes + optimizer_bytes
    measurement = Measurement(
        activation_bytes=meter.nbytes,
        graph_bytes=graph_bytes,
        param_bytes=model_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        peak_bytes=state_bytes + peak.peak_bytes,
        by_kind=meter.by_kind(),
        peak_by_phase={phase: state_bytes + b for phase, b in peak.phase_peaks.items()},
    )
    del model, optimizer, loss, meter
    # Patched forwards are bound methods on their module (a reference cycle): collect now, or
    # the next recipe's model is built while this one is still in memory.
    gc.collect()
    return measurement, patched, plan, kinds


@contextlib.contextmanager
def _layer_phase_marks(model, peak: PeakMemory):
    """Marks the backward's phases at the layer stack's ends: "layer backward" when the last
    layer's output gradient arrives, "embedding backward" when the first layer's input gradient
    does. Hooks are set on the first forward only; a layer whose output or input needs no
    gradient there (frozen embeddings, layers checkpointed inside an autograd.Function) leaves
    its mark out, and its phase runs into the one before. Encoder-decoders are left unmarked: a
    phase would span both stacks. Of several stacks (a vision-language model's towers) the
    language model's is marked: the last stack in module order."""
    from hf_actq.integrations.checkpointing import checkpointed_layers

    stacks: dict[str, list] = {}
    for path, layer in checkpointed_layers(model).items():
        stacks.setdefault(path.rpartition(".")[0], []).append(layer)
    if not stacks or getattr(model.config, "is_encoder_decoder", False):
        yield
        return
    layers = list(stacks.values())[-1]

    def mark_on_gradient(tensor, phase):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: peak.mark(phase))

    def on_last_output(module, args, output):
        handles.pop("last").remove()
        mark_on_gradient(
            output if isinstance(output, torch.Tensor) else output[0], "layer backward"
        )

    def on_first_input(module, args, kwargs):
        handles.pop("first").remove()
        hidden = args[0] if args else kwargs.get("hidden_states")
        mark_on_gradient(hidden, "embedding backward")

    handles = {
        "last": layers[-1].register_forward_hook(on_last_output),
        "first": layers[0].register_forward_pre_hook(on_first_input, with_kwargs=True),
    }
    try:
        yield
    finally:
        for handle in handles.values():
            handle.remove()


@contextlib.contextmanager
def _quiet(active: bool):
    """Hides hf_actq's warnings (the calibrate-me reminder) while ``active``."""
    logger = logging.getLogger("hf_actq")
    level = logger.level
    if active:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _create_optimizer_state(optimizer, trainable) -> None:
    """AdamW allocates its moments on the first step; take that step with lr 0 and zero
    gradients (parameters unchanged) so the measured step runs with the state in memory, as
    every step after the first does."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _inputs(config, task, batch_size, seq_len, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    vocab_size = _text_config(config).vocab_size
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


def _model_tensors(model):
    yield from model.parameters()
    yield from model.buffers()
    for p in model.parameters():
        # bitsandbytes keeps its 4-bit absmax/code tensors on the parameter's quant_state.
        state = getattr(p, "quant_state", None)
        while state is not None:
            yield from (v for v in vars(state).values() if isinstance(v, torch.Tensor))
            state = getattr(state, "state2", None)


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _distinct_bytes(tensors) -> int:
    storages = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
