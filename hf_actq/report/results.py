"""The result of a memory report: measurements per recipe, as JSON, Markdown and files."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from hf_actq.memory.meter import OP_KINDS
from hf_actq.report.plots import plot, plot_plan
from hf_actq.report.recipes import STOCK_CHECKPOINTING


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
    description: str = ""  # what the recipe keeps, in words (report.recipes.describe_recipe)


@dataclass
class MemoryReport:
    model: str
    model_type: str
    num_layers: int
    # [num_layers] when whole; [1, 2] when extrapolated ([4, 8] for a hybrid repeating every 4)
    measured_layers: list[int]
    batch_size: int
    seq_len: int
    dtype: str
    peft: str
    task: str
    device: str
    gpu_memory_bytes: int
    results: list[RecipeResult]
    note: str = ""  # what the measurement leaves out, said under the heading
    # What made it: the command, the versions and the source commit (set by the CLI).
    provenance: dict = field(default_factory=dict)

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
            if (result.config or {}).get("checkpoint_bits") is not None or (
                result.label == STOCK_CHECKPOINTING
            ):
                # Checkpointed layers are recomputed one at a time in backward, and each keeps
                # its activations until its backward is done: about one stock layer's worth
                # (the baseline's per layer; less when compress_checkpointed) on top.
                per_sample += base.activation_bytes / self.num_layers / self.batch_size
            room = self.gpu_memory_bytes - m.model_state_bytes
            rows.append(
                {
                    "recipe": result.label,
                    "keeps": result.description,
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
            f"| recipe | what it keeps for backward | activation memory | compression | saved "
            f"| model state | {peak_label} | max batch on {gpu:g} GiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
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
                f"| {row['recipe']} | {row['keeps']} | {format_bytes(row['activation_bytes'])} | "
                f"{row['compression']:.2f}x | {100 * row['activation_saved']:.1f}% | "
                f"{format_bytes(row['model_state_bytes'])} | {format_bytes(row['peak_bytes'])}{phase}{flag} | "
                f"{batch}{gain} |"
            )
        lines += ["", legend(gpu, self.scaled)]
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
            cells = [format_bytes(result.measurement.by_kind.get(kind, 0)) for kind in kinds]
            lines.append(f"| {result.label} | " + " | ".join(cells) + " |")
        for result in self.results:
            if result.plan is not None:
                lines += ["", *plan_markdown(result)]
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


def legend(gpu_gib: float, scaled: bool) -> str:
    """What the main table's columns count, said under it."""
    peak = "estimated from the measured depths" if scaled else "measured"
    return (
        "Activation memory: the bytes autograd holds for backward when the forward pass ends "
        "(codes, scales, masks and seeds included; weights not; each storage once); "
        "compression and saved are against the baseline, the unpatched model. Model state: "
        f"weights, gradients and AdamW's moments. Peak ({peak}): the most memory the step held "
        "at any moment, model state included, and the phase it came in. Max batch: the "
        f"largest batch whose activation memory fits beside the model state in {gpu_gib:g} "
        "GiB; a recipe that recomputes layers also holds one layer's unpatched activations "
        "while that layer's backward runs, so its max batch can be below that of a recipe "
        "that keeps more. How each byte is counted: docs/memory.md."
    )


def plan_markdown(result: RecipeResult) -> list[str]:
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
    unit = "bit" if plan.target_bits == 1 else "bits"
    lines = [
        f"Bit plan of {result.label}, {plan.target_bits:g} {unit} on average: by {amount} "
        f"(an even spread of the same bits keeps {info['even_bytes']:,}). "
        f"{info['measured']} tensors were measured on {examples} "
        f"example{'' if examples == 1 else 's'} and {info['estimated']} took their kind's median "
        f"sensitivity, in {info['seconds']:.1f} s"
        + (" (on the measured model, before extrapolation)." if info.get("scaled") else "."),
        "",
        "| slot kind | settings (tensors) |",
        "|---|---|",
    ]
    for kind, counts in sorted(plan.summary(result.slot_kinds).items()):
        cells = ", ".join(f"{label} ({n})" for label, n in sorted(counts.items()))
        lines.append(f"| {kind} | {cells} |")
    return lines + [
        "",
        "Settings: `aq B/G` is ALAM's average quantization, G values averaged into one code of "
        "B x G bits (0.5/4: ALAM's 0.5 bit); `uniform B` and `rotated B` are B-bit "
        "stochastic rounding (rotated: after random signs and a Hadamard rotation); "
        "`few-bit B` is a B-bit activation derivative; `exact` is kept as is.",
    ]


def format_bytes(nbytes: float) -> str:
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
