"""The GPU speed check: device time apart from host time, for a change and its baseline side by
side, in about a minute a run (issue 69's "measurement you can act on").

    bash benchmarks/gpu/speed.sh                       # this tree and .baseline, A B A B
    python benchmarks/gpu/speed.py --label new --out DIR [--dry-run] [--match TEXT ...]
    python benchmarks/gpu/speed.py --compare --out DIR  # speed.md from the runs' JSON

Kernels, at 16 Mi elements in fp32 and bf16, each against the op it replaces or accompanies:
- **device µs**: the kernels' durations as torch.profiler records them, summed over 10 calls,
  each after the L2 cache is flushed (a 256 MiB buffer negated; its kernels left out): what the
  GPU spends, whatever the host does;
- **host µs**: from an idle device until the call returns: what the host spends issuing it;
- **GB/s**: the bytes the case must move (its floor: inputs read once, outputs written once)
  over its device time, beside a device-to-device copy's in the same run.
Steps: the LLaMA2-7B slice with LoRA and MiniLM's shapes in fp32, every recipe and stock
checkpointing interleaved with the unpatched step, the median of 5 rounds, and host ms.

``hf_actq`` is imported from the tree ``HF_ACTQ_TREE`` names (an editable install of another
checkout set aside): ``speed.sh`` runs this file against both trees, so it uses only what both
have (codecs' pack and unpack, ``FewBitActivation``, ``apply``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("HF_ACTQ_TREE"):
    # An editable install's finder comes before PYTHONPATH's entries: set it aside.
    sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", "")]
    sys.path.insert(0, os.environ["HF_ACTQ_TREE"])

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import check  # noqa: E402

CALLS = 10
FLUSH_BYTES = 256 << 20  # over the 50 MiB L2 of an H100 or H200


def device_seconds(fn, device: torch.device, calls: int = CALLS) -> float:
    """Device seconds per call of ``fn`` (see the module); wall seconds on the CPU."""
    if device.type != "cuda":  # the dry run: one warm-up call and one timed, interpreted
        return check._timed(fn, device, 1)
    fn()  # compiles what it launches
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    micros = sum(e.device_time_total for e in kernels if "bitwise_not" not in e.name)
    return micros / calls / 1e6


def host_seconds(fn, device: torch.device) -> float:
    return check._host_timed(fn, device, 5 if device.type == "cuda" else 1)


def kernel_cases(device: torch.device, dtype: torch.dtype, dry: bool) -> list:
    """``(name, ours, reference, bytes ours must move, bytes the reference moves)``."""
    from torch import nn

    from hf_actq.codecs import (
        MaskCodec,
    )
    from hf_actq.ops import FewBitActivation

    rows, width = (8, 128) if dry else (4096, 4096)  # 16 Mi elements
    n = rows * width
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, width, generator=generator).to(device=device, dtype=dtype)
    grad = torch.randn(x.shape, generator=generator).to(device=device, dtype=dtype)
    size = x.element_size()
    cases = []

    def activation(name, torch_fn, bits=3):
        op = FewBitActivation(name, bits=bits)

        def run(fn):
            leaf = x.detach().requires_grad_()
            fn(leaf).backward(grad)

        # fused floor: x read, y and codes written; grad and codes read, grad_x written
        floor = n * (4 * size + 2 * bits / 8)
        cases.append((f"few-bit {name} {bits}-bit fwd+bwd", functools.partial(run, op),
                      functools.partial(run, torch_fn), floor, 4 * n * size))  # fmt: skip

    activation("gelu", nn.functional.gelu)
    activation("silu", nn.functional.silu)

    # LLaMA's gated product act(gate) * up with act(gate) and up kept 4-bit, against PyTorch's
    # (which keeps gate, act(gate) and up): a tree without the fused kernels times its ops.
    try:
        from hf_actq.codecs import AverageQuantCodec
        from hf_actq.ops.dedup import PackCache
        from hf_actq.ops.fewbit_activation import ActivationTable
        from hf_actq.ops.gated_mlp import CODEC_SLOTS, gated_down
        from hf_actq.ops.state import default_state
    except ImportError:
        pass
    else:
        up = torch.randn(x.shape, generator=generator).to(device=device, dtype=dtype)
        state = default_state(None, AverageQuantCodec(4, 1), PackCache(), CODEC_SLOTS,
                              activation=ActivationTable("silu", 3))  # fmt: skip

        def product(fn):
            gate, up_leaf = x.detach().requires_grad_(), up.detach().requires_grad_()
            fn(gate, up_leaf).backward(grad)

        def stock(gate, up_leaf):
            return nn.functional.silu(gate) * up_leaf

        # fused floor: gate and up read, the product, act(gate) and up 4-bit and the codes
        # written; grad, the packs and the codes read, both gradients written
        packed = 2 * AverageQuantCodec(4, 1).nbytes(x.shape)
        floor = n * (6 * size + 2 * 3 / 8) + 2 * packed
        cases.append(("gated silu product, 4-bit operands, fwd+bwd",
                      functools.partial(product, lambda g, u: gated_down(state, g, u, None)),
                      functools.partial(product, stock), floor, 14 * n * size))  # fmt: skip

    # LLaMA's RMSNorm with x_hat kept 4-bit (one kernel packs it and writes the output; the
    # backward kernels dequantize it), against HF's, which keeps x and its fp32 statistics.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_actq.codecs import AverageQuantCodec
    from hf_actq.ops.dedup import PackCache
    from hf_actq.ops.norm import CompressedRMSNorm

    rms_norm = LlamaRMSNorm(width).to(device=device, dtype=dtype)
    compressed_rms_norm = CompressedRMSNorm(rms_norm, AverageQuantCodec(4, 1), PackCache())

    def normed(module):
        leaf = x.detach().requires_grad_()
        module(leaf).backward(grad)

    # floor: x read, y and x_hat's pack written; grad and the pack read, grad_x written
    packed = AverageQuantCodec(4, 1).nbytes(x.shape)
    cases.append(("RMSNorm, 4-bit x_hat, fwd+bwd", functools.partial(normed, compressed_rms_norm),
                  functools.partial(normed, rms_norm), 4 * n * size + 2 * packed,
                  4 * n * size))  # fmt: skip

    # The same norm keeping its output instead of x_hat ("fewbit": the next linear keeps the
    # output anyway), the backward kernels rebuilding x_hat from it.
    sharing_rms_norm = CompressedRMSNorm(rms_norm, None, PackCache(), share_output=True)
    # floor: x read, y written; grad and y read, grad_x written
    cases.append(("RMSNorm keeping its output, fwd+bwd", functools.partial(normed, sharing_rms_norm),
                  functools.partial(normed, rms_norm), 4 * n * size, 4 * n * size))  # fmt: skip

    # Dropout that keeps its seed (the default mode, in every BERT recipe): one kernel draws the
    # mask forward and again backward, against nn.Dropout, which writes and reads a bool mask.
    from hf_actq.ops.dropout import CompressedDropout

    # floor: x read, y written; grad read, grad_x written
    cases.append(("dropout 0.1, seed kept, fwd+bwd", functools.partial(normed, CompressedDropout(0.1)),
                  functools.partial(normed, nn.Dropout(0.1)), 4 * n * size,
                  4 * n * size + 2 * n))  # fmt: skip

    def two_copies():
        x.clone()
        x.clone()

    for label, codec in check.timed_codecs(stochastic=True).items():
        source = (x > 0).to(dtype) if isinstance(codec, MaskCodec) else x

        def ours(codec=codec, source=source):
            codec.unpack(codec.pack(source))

        packed = codec.pack(source).nbytes
        cases.append((f"{label} pack+unpack", ours, two_copies, 2 * n * size + 2 * packed,
                      4 * n * size))  # fmt: skip

    # Attention's q as it lies ([batch, heads, seq, dim] over [batch, seq, heads, dim]): packed
    # in place, against the copy then the pack that every q, k and v took before.
    q = x.view(2, 2, 2, 128) if dry else x.view(2, 2048, 32, 128)
    q = q.transpose(1, 2)
    codecs = check.timed_codecs(stochastic=True)
    # (SmaQ reads q where it lies when each head holds whole 4,096-value tiles: on the GPU's
    # shape, not the dry run's.)
    for label in ("uniform 4-bit", "BLPA 4-bit", "SmaQ"):
        codec = codecs[label]
        packed = codec.pack(q).nbytes
        cases.append((f"{label} pack of a transposed q", functools.partial(codec.pack, q),
                      lambda codec=codec: codec.pack(q.contiguous()), n * size + packed,
                      3 * n * size + packed))  # fmt: skip

    # The rotated codec as the composition it was (the library's matrix product into full-size
    # coefficients, AQ's kernel; and back), beside its fused kernels above: per dtype, the GPU
    # says which is faster (fp32 tiles take three bf16 products in the fused kernels).
    try:
        from hf_actq.codecs.rotated import RotatedSampleCodec, _fixed_rotation
        from hf_actq.kernels import aq_dequantize, aq_quantize
        from hf_actq.kernels.rotated import coefficient_dtype, rotated_back, rotated_rows
    except ImportError:
        pass
    else:
        rotation = _fixed_rotation(device, coefficient_dtype(dtype))

        def composed():
            coeffs = rotated_rows(x, rotation)
            data, mins, scales = aq_quantize(coeffs.view(-1), 1, 4, 128, True, 1234)
            shape, coeff_dtype = list(coeffs.shape), rotation.dtype
            back = aq_dequantize(data, mins, scales, shape, coeff_dtype, 4, 1, 128)
            rotated_back(back, rotation, x.shape, dtype)

        packed = RotatedSampleCodec(bits=4, group_size=1).pack(x).nbytes
        cases.append(("rotated 4-bit pack+unpack, rotation outside the kernels", composed,
                      two_copies, 2 * n * size + 2 * packed, 4 * n * size))  # fmt: skip
    return cases


def run_kernels(device, dry: bool, match: list[str] | None = None) -> list:
    """Each kernel case's row; with ``match``, only the cases whose name holds one of them."""
    rows = []
    for dtype_name, dtype in ({"fp32": torch.float32} if dry else {
            "fp32": torch.float32, "bf16": torch.bfloat16}).items():  # fmt: skip
        source = torch.randn(1 << (10 if dry else 24), device=device, dtype=dtype)
        copy_s = device_seconds(source.clone, device)
        copy_gbs = 2 * source.numel() * source.element_size() / copy_s / 1e9
        for name, ours, reference, floor_bytes, reference_bytes in kernel_cases(device, dtype, dry):
            if match and not any(part in name for part in match):
                continue
            ours_s, reference_s = device_seconds(ours, device), device_seconds(reference, device)
            rows.append(
                {
                    "case": name,
                    "dtype": dtype_name,
                    "device us": ours_s * 1e6,
                    "reference device us": reference_s * 1e6,
                    "device ratio": ours_s / reference_s,
                    "host us": host_seconds(ours, device) * 1e6,
                    "reference host us": host_seconds(reference, device) * 1e6,
                    "GB/s": floor_bytes / ours_s / 1e9,
                    "reference GB/s": reference_bytes / reference_s / 1e9,
                    "copy GB/s": copy_gbs,
                }
            )
    return rows


STEP_RECIPES = ("baseline", "fewbit", "uniform-4", "alam-1-even", "checkpoint",
                "stock-checkpointing")  # fmt: skip


def run_steps(device, dry: bool, rounds: int = 5) -> list:
    rows = []
    if dry:  # the kernels ran above; the interpreter would only be slow here
        os.environ["HF_ACTQ_DISABLE_TRITON"] = "1"
    models = [m for m in check.step_models(device, dry) if "bf16 autocast" not in m[0]]
    for model_name, build, autocast in models:
        model, batch = build()
        runs = {recipe: check._patched(model, recipe) for recipe in STEP_RECIPES}
        del model
        step = functools.partial(check._step, runs, batch, device, autocast)
        times = {recipe: [] for recipe in STEP_RECIPES}
        for recipe in STEP_RECIPES:
            step(recipe)
        for index in range(1 if dry else rounds):
            order = STEP_RECIPES[index % 6 :] + STEP_RECIPES[: index % 6]
            for recipe in order:
                times[recipe].append(check._timed(functools.partial(step, recipe), device, 1))
        base = statistics.median(times["baseline"])
        for recipe in STEP_RECIPES:
            rows.append(
                {
                    "case": f"{model_name}: {recipe}",
                    "step ms": statistics.median(times[recipe]) * 1e3,
                    "time ratio": statistics.median(times[recipe]) / base,
                    "host ms": check._host_timed(functools.partial(step, recipe), device, 1) * 1e3,
                }
            )
        del runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def fused_forward_verdicts() -> dict:
    """Per activation and dtype this run used, whether the fused few-bit forward's output was
    found equal to PyTorch's (its compile options) or PyTorch computed it; {} for a tree
    without the probe."""
    from hf_actq.kernels import fewbit

    verdicts = getattr(fewbit, "EXACT_FORWARD", {})
    return {
        f"{activation} {str(dtype).removeprefix('torch.')}": options or "PyTorch's output"
        for (activation, _, dtype, _), options in verdicts.items()
    }


def compare(out: Path) -> str:
    """``speed.md``: per case, the median over rounds of each label's figures, and new / base."""
    runs = {}
    for path in sorted(out.glob("speed-*.json")):
        data = json.loads(path.read_text())
        label = data["label"].rsplit("-", 1)[0]  # "new-1" -> "new"
        for row in data["kernels"] + data["steps"]:
            key = (row["case"], row.get("dtype", ""))
            runs.setdefault(key, {}).setdefault(label, []).append(row)
    lines = ["# GPU speed: this tree against its baseline", ""]
    environment = json.loads(next(iter(sorted(out.glob("speed-*.json")))).read_text())
    lines += [f"{environment['environment']['device']}; medians over each label's runs.", ""]
    lines += ["| case | dtype | new | base | new / base | new vs reference | new host | GB/s (copy) |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (case, dtype), labels in runs.items():
        new, base = labels.get("new", []), labels.get("base", [])
        time_key = "device us" if dtype else "step ms"
        unit = " us" if dtype else " ms"
        new_t = statistics.median(r[time_key] for r in new) if new else float("nan")
        base_t = statistics.median(r[time_key] for r in base) if base else float("nan")
        ratio_key = "device ratio" if dtype else "time ratio"
        new_ratio = statistics.median(r[ratio_key] for r in new) if new else float("nan")
        host_key = "host us" if dtype else "host ms"
        host = statistics.median(r[host_key] for r in new) if new else float("nan")
        bandwidth = (
            f"{statistics.median(r['GB/s'] for r in new):.0f} "
            f"({statistics.median(r['copy GB/s'] for r in new):.0f})"
            if new and dtype
            else ""
        )
        lines.append(
            f"| {case} | {dtype} | {new_t:.1f}{unit} | {base_t:.1f}{unit} | {new_t / base_t:.2f}x "
            f"| {new_ratio:.2f}x | {host:.1f}{unit} | {bandwidth} |"
        )
    verdicts = {}
    for path in sorted(out.glob("speed-new-*.json")):
        verdicts.update(json.loads(path.read_text()).get("fused few-bit forward", {}))
    if verdicts:
        lines += ["", "Fused few-bit forward (new tree): output from the kernel where the probe "
                  "found it equal to PyTorch's, with these compile options:", ""]  # fmt: skip
        lines += [f"- {case}: {verdict}" for case, verdict in sorted(verdicts.items())]
    text = "\n".join(lines) + "\n"
    (out / "speed.md").write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gpu"))
    parser.add_argument("--label", default="new-1", help="<tree>-<round>: new-1, base-1, ...")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    parser.add_argument("--compare", action="store_true", help="speed.md from the runs' JSON")
    parser.add_argument("--steps", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--match", nargs="+", metavar="TEXT",
                        help="time only the kernel cases whose name holds one of these: a short "
                        "loan retimes the kernel a change touched")  # fmt: skip
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        print(compare(out))
        return 0
    if args.dry_run:
        from hf_actq.kernels import kernels_on_cpu

        dispatch, device = kernels_on_cpu(), torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run")
    else:
        dispatch, device = check.contextlib.nullcontext(), torch.device("cuda")
    import hf_actq

    tree = os.environ.get("HF_ACTQ_TREE")
    if tree and not Path(hf_actq.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"hf_actq came from {hf_actq.__file__}, not from {tree}")
    began = time.monotonic()
    with dispatch:
        kernels = run_kernels(device, args.dry_run, args.match)
        steps = run_steps(device, args.dry_run) if args.steps else []
    data = {
        "label": args.label,
        "commit": check._commit(),
        "hf_actq": str(Path(hf_actq.__file__).parent),
        "environment": check.environment(device),
        "seconds": round(time.monotonic() - began, 1),
        "kernels": kernels,
        "steps": steps,
        "fused few-bit forward": fused_forward_verdicts(),
    }
    (out / f"speed-{args.label}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"speed {args.label}: {data['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
