"""Peak bytes of a LLaMA MLP's step with the gated product's kernels (``hf_actq::gated_forward``
and ``gated_backward``) against the op-by-op path, side by side in one run.

    python benchmarks/bench_gated_peak.py --output benchmarks/results/bench_gated_peak.json

The kernels run where Triton does (a GPU); here Triton's interpreter runs them on the CPU, through
the same launchers, so the allocations are the GPU's (the CPU allocator's events under the
profiler, ``hf_actq.memory.PeakMemory``). The fused forward is forced on (as where the few-bit
forward's probe finds it exact: the interpreter's SiLU is not PyTorch's to the last bit). Shapes:
bf16, 4 x 256 tokens, hidden 512, intermediate 1376 (LLaMA's ratio), uniform 4-bit operands,
3-bit SiLU codes; phases forward and backward, above what was live at the start.
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from provenance import write_json  # noqa: E402


def phase_peaks(make_module, x, grad) -> dict:
    """Bytes above the start at the peak of the forward and of the backward of a fresh
    ``make_module()`` on ``x``, kernels run (the second of two rounds: the first allocates the
    module's tables)."""
    from hf_actq.kernels import kernels_on_cpu
    from hf_actq.memory.peak import PeakMemory

    module = make_module()
    rounds = []
    with kernels_on_cpu():
        for _ in range(2):
            leaf = x.clone().requires_grad_()
            with PeakMemory("cpu", phase="forward") as peak:
                y = module(leaf)
                peak.mark("backward")
                y.backward(grad)
                del y
            rounds.append(peak.phase_peaks)
            for p in module.parameters():
                p.grad = None
    return rounds[-1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/bench_gated_peak.json")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hf_actq.codecs import uniform
    from hf_actq.kernels import gated_product
    from hf_actq.kernels.fewbit import EXACT_OPTION_CANDIDATES
    from hf_actq.ops import gated_mlp
    from hf_actq.ops.dedup import PackCache
    from hf_actq.ops.gated_mlp import CompressedGatedMLP

    gated_product.exact_forward_options = lambda *a: EXACT_OPTION_CANDIDATES[0]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, hidden_act="silu")
    mlp = LlamaMLP(config).to(torch.bfloat16)
    x = torch.randn(4, 256, 512, dtype=torch.bfloat16)
    grad = torch.randn_like(x)

    def make_module():
        return CompressedGatedMLP(mlp, uniform(4), activation_bits=3, cache=PackCache())

    fused = phase_peaks(make_module, x, grad)
    gated_mlp.product_forward = lambda *args: None
    gated_mlp._one_kernel_takes = lambda *args: False
    composed = phase_peaks(make_module, x, grad)
    intermediate = 4 * 256 * 1376 * 2
    rows = {
        phase: {
            "kernels MiB": fused[phase] / 2**20,
            "op by op MiB": composed[phase] / 2**20,
            "saved, in intermediate-size bf16 tensors": (composed[phase] - fused[phase])
            / intermediate,
        }
        for phase in fused
    }
    for phase, row in rows.items():
        print(phase, {k: round(v, 2) for k, v in row.items()})
    write_json(args.output, {"phases": rows})


if __name__ == "__main__":
    main()
