"""Host time per compressed op against the stock op, on the CPU, with the Triton kernels stubbed.

On a GPU a small step is bound by the host: the first H200 run measured MiniLM's step at 15.6 ms
for about 460 launches, and a compressed op's Python, dispatch, launcher and allocations cost
several times a stock op's. Here every hf_actq Triton kernel is a stub that returns at once and
CPU tensors take the path CUDA tensors take (``hf_actq.testing.stubbed_kernels``), on tiny
tensors and one thread, so what is timed is the host's part alone: forward and backward of each
op, the median of interleaved repeats (stock and compressed alternate), and the ratio. The
stock op's time here is CPU compute on tiny tensors, not a GPU's host time; the difference is
what hf_actq adds per op.

    python benchmarks/bench_host.py --output benchmarks/results/bench_host.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton importable without a GPU; kernels stubbed

import torch  # noqa: E402
from provenance import write_json  # noqa: E402
from torch import nn  # noqa: E402

from hf_actq.codecs import AverageQuantCodec  # noqa: E402
from hf_actq.ops import CompressedDropout, CompressedLayerNorm, FewBitActivation  # noqa: E402
from hf_actq.ops.dedup import PackCache  # noqa: E402
from hf_actq.ops.linear import CompressedLinear  # noqa: E402
from hf_actq.testing import stubbed_kernels  # noqa: E402


def cases():
    """``(name, stock module, compressed module, input shape)``."""
    codec = AverageQuantCodec(4, 1)
    linear = nn.Linear(64, 64)
    norm = nn.LayerNorm(64)
    return [
        ("Linear 64x64", linear, CompressedLinear(linear, codec, PackCache()), (16, 64)),
        ("LayerNorm 64", norm, CompressedLayerNorm(norm, codec, PackCache()), (16, 64)),
        ("GELU, 3-bit derivative", nn.GELU(), FewBitActivation("gelu", bits=3), (16, 64)),
        ("Dropout 0.1 (seed)", nn.Dropout(0.1), CompressedDropout(0.1), (16, 64)),
        (*_moe_blocks(), (1, 16, 32)),
    ]


def _moe_blocks():
    """A tiny Qwen3-MoE block (4 experts, 2 a token) as it is and as ``hf_actq.apply`` patches
    it ("uniform"): the router's forward under the mode that sends its linear to the compressed
    op, and the compressed experts op."""
    import copy

    import hf_actq
    from hf_actq.testing import more_model

    model, _ = more_model("qwen3_moe")
    patched = copy.deepcopy(model)
    hf_actq.apply(patched, hf_actq.ActQConfig.from_recipe("uniform"))
    block = "Qwen3-MoE block: router and experts"
    return block, model.model.layers[0].mlp, patched.model.layers[0].mlp


def _fwd_bwd(module, x, grad):
    module(x).backward(grad)


def time_pair(stock, ours, repeats: int) -> tuple[float, float]:
    times = ([], [])
    for _ in range(repeats):
        for fn, sink in zip((stock, ours), times):
            began = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - began)
    return statistics.median(times[0]), statistics.median(times[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--output", help="write the rows here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    with stubbed_kernels():
        for name, stock, ours, shape in cases():
            x = torch.randn(shape, requires_grad=True)
            grad = torch.randn(shape)
            for module in (stock, ours):  # warm-up: caches, lazy imports
                for _ in range(20):
                    _fwd_bwd(module, x, grad)
            stock_s, ours_s = time_pair(
                functools.partial(_fwd_bwd, stock, x, grad),
                functools.partial(_fwd_bwd, ours, x, grad),
                args.repeats,
            )
            rows.append(
                {
                    "op": name,
                    "stock us": stock_s * 1e6,
                    "hf_actq us": ours_s * 1e6,
                    "added us": (ours_s - stock_s) * 1e6,
                    "ratio": ours_s / stock_s,
                }
            )
    print("| op (forward + backward) | stock µs | hf_actq µs | added µs | ratio |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['op']} | {row['stock us']:.1f} | {row['hf_actq us']:.1f} | "
            f"{row['added us']:.1f} | {row['ratio']:.2f}x |"
        )
    if args.output:
        write_json(args.output, {"repeats": args.repeats, "threads": 1, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
