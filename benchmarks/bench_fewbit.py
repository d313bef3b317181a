"""Few-bit activation vs torch's own activation, side by side in one process.

For each size: bytes autograd keeps for backward (counted by SavedTensorMeter) and the time of
forward, backward and both, as medians over interleaved repeats (baseline and few-bit alternate,
so drift in machine load hits both). Prints a table with ratios and writes JSON.

    python benchmarks/bench_fewbit.py --output benchmarks/results/bench_fewbit.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from provenance import write_json

from hf_actq import ActQConfig, SavedTensorMeter, apply
from hf_actq.ops import FewBitActivation

BASELINES = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def _time_pair(fn_a, fn_b, repeats):
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, sink in ((fn_a, times_a), (fn_b, times_b)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def bench_case(activation, bits, shape, dtype, repeats):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    grad = torch.randn(shape, dtype=dtype)
    baseline = BASELINES[activation]
    fewbit = FewBitActivation(activation, bits)

    with SavedTensorMeter() as meter:
        baseline(x)
    base_bytes = meter.nbytes
    with SavedTensorMeter() as meter:
        fewbit(x)
    fewbit_bytes = meter.nbytes

    def forward(fn):
        return lambda: fn(x)

    def both(fn):
        return lambda: fn(x).backward(grad)

    base_y, fewbit_y = baseline(x), fewbit(x)

    def backward(y):
        return lambda: torch.autograd.grad(y, x, grad, retain_graph=True)

    for fn in (forward(baseline), forward(fewbit), both(baseline), both(fewbit)):
        fn()  # warm up allocator and threads
    fwd = _time_pair(forward(baseline), forward(fewbit), repeats)
    bwd = _time_pair(backward(base_y), backward(fewbit_y), repeats)
    total = _time_pair(both(baseline), both(fewbit), repeats)
    return {
        "activation": activation,
        "bits": bits,
        "shape": list(shape),
        "numel": x.numel(),
        "dtype": str(dtype).replace("torch.", ""),
        "saved_bytes": {"torch": base_bytes, "fewbit": fewbit_bytes},
        "saved_ratio": base_bytes / fewbit_bytes,
        "seconds": {
            "forward": {"torch": fwd[0], "fewbit": fwd[1]},
            "backward": {"torch": bwd[0], "fewbit": bwd[1]},
            "forward_backward": {"torch": total[0], "fewbit": total[1]},
        },
        "time_ratio": {
            "forward": fwd[1] / fwd[0],
            "backward": bwd[1] / bwd[0],
            "forward_backward": total[1] / total[0],
        },
    }


def bench_training_step(bits, batch_size, seq_len, repeats):
    """One AdamW step of the demo's tiny BERT, exact vs few-bit GELU (what a user feels)."""
    import copy

    from hf_actq import demo

    baseline = demo.tiny_bert()
    fewbit = copy.deepcopy(baseline)
    apply(fewbit, ActQConfig.from_recipe("fewbit", bits=bits))
    ids, labels = next(demo.synthetic_batches(1, batch_size, seq_len))
    steps = {}
    for name, model in (("torch", baseline), ("fewbit", fewbit)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        steps[name] = step
    base, few = _time_pair(steps["torch"], steps["fewbit"], repeats)
    return {
        "bits": bits,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "seconds": {"torch": base, "fewbit": few},
        "time_ratio": few / base,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--activations", nargs="+", default=["gelu"], choices=sorted(BASELINES))
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 3, 4])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["8x128x3072", "16x512x3072", "8x512x11008"],
        help="shapes as AxBxC (e.g. batch x seq x intermediate)",
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--step-bits", type=int, nargs="*", default=[3])
    parser.add_argument("--output", help="write JSON results here")
    args = parser.parse_args(argv)

    rows = []
    header = (
        f"{'act':10s} {'bits':>4s} {'shape':>14s} {'dtype':>8s} {'saved torch':>12s} "
        f"{'saved fewbit':>12s} {'ratio':>6s} {'fwd x':>6s} {'bwd x':>6s} {'f+b x':>6s}"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor()}")
    print(header)
    for activation in args.activations:
        for dtype_name in args.dtypes:
            for size in args.sizes:
                shape = tuple(int(s) for s in size.split("x"))
                for bits in args.bits:
                    row = bench_case(
                        activation, bits, shape, getattr(torch, dtype_name), args.repeats
                    )
                    rows.append(row)
                    saved, ratio = row["saved_bytes"], row["time_ratio"]
                    print(
                        f"{activation:10s} {bits:4d} {size:>14s} {dtype_name:>8s} "
                        f"{saved['torch'] / 2**20:9.1f} MiB {saved['fewbit'] / 2**20:9.2f} MiB "
                        f"{row['saved_ratio']:5.1f}x {ratio['forward']:5.2f}x "
                        f"{ratio['backward']:5.2f}x {ratio['forward_backward']:5.2f}x",
                        flush=True,
                    )
    steps = []
    if args.step_bits:
        print("\ntraining step (forward + backward + AdamW) of the demo's tiny BERT, fp32:")
        for bits in args.step_bits:
            row = bench_training_step(bits, batch_size=16, seq_len=128, repeats=args.repeats)
            steps.append(row)
            print(
                f"  {bits}-bit GELU: torch {row['seconds']['torch'] * 1e3:.1f} ms, few-bit "
                f"{row['seconds']['fewbit'] * 1e3:.1f} ms, ratio {row['time_ratio']:.3f}x",
                flush=True,
            )
    if args.output:
        result = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "rows": rows,
            "training_steps": steps,
        }
        write_json(args.output, result)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
