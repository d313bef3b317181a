"""Charts of a memory report: activation and peak memory per recipe, and an adaptive plan's
bits by layer (matplotlib, imported when a chart is drawn)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_actq.memory.meter import OP_KINDS

if TYPE_CHECKING:
    from hf_actq.report.results import MemoryReport, RecipeResult


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
