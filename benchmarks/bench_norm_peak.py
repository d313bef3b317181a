"""Peak bytes of a norm's step with its kernels (``hf_actq::norm_pack`` forward,
``norm_backward_packed`` backward) against the composition (x_hat computed, packed, unpacked, then
the backward kernels), side by side in one run; and of a memory-sharing norm's backward
(``norm_backward_from_output``: x_hat rebuilt from the output inside the backward kernels)
against x_hat rebuilt op by op, then the backward kernels.

    python benchmarks/bench_norm_peak.py --output benchmarks/results/bench_norm_peak.json

As ``bench_gated_peak.py``: Triton's interpreter runs the kernels on the CPU through the same
launchers, so the allocations are the GPU's. Shapes: bf16, 4 x 256 tokens, hidden 1024, uniform
4-bit x_hat; LLaMA's RMSNorm and a LayerNorm; phases forward and backward, above what was live
at the start, in MiB and in hidden-size bf16 tensors. (On the CPU a LayerNorm's half-precision
statistics come back in bf16 and are recomputed in fp32 in both paths; CUDA gives fp32 ones.)
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from bench_gated_peak import phase_peaks  # noqa: E402
from provenance import write_json  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/bench_norm_peak.json")
    args = parser.parse_args(argv)
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_actq.codecs import uniform
    from hf_actq.kernels import norm as norm_kernels
    from hf_actq.ops import norm as norm_ops
    from hf_actq.ops.dedup import PackCache
    from hf_actq.ops.norm import CompressedLayerNorm, CompressedRMSNorm

    torch.manual_seed(0)
    x = torch.randn(4, 256, 1024, dtype=torch.bfloat16) * 3 + 1
    grad = torch.randn_like(x)
    norms = {
        "rms_norm": (LlamaRMSNorm(1024).to(torch.bfloat16), CompressedRMSNorm),
        "layer_norm": (nn.LayerNorm(1024).to(torch.bfloat16), CompressedLayerNorm),
    }
    kernel_codec, in_kernel = norm_ops._kernel_codec, norm_ops._dequantized_in_kernel
    hidden = x.numel() * x.element_size()
    rows = {}
    for name, (norm, wrapper) in norms.items():

        def make_module(norm=norm, wrapper=wrapper):
            return wrapper(norm, uniform(4), cache=PackCache())

        norm_ops._kernel_codec, norm_ops._dequantized_in_kernel = kernel_codec, in_kernel
        fused = phase_peaks(make_module, x, grad)
        norm_ops._kernel_codec = lambda *args: None
        norm_ops._dequantized_in_kernel = lambda *args: False
        composed = phase_peaks(make_module, x, grad)
        rows[name] = {
            phase: {
                "kernels MiB": fused[phase] / 2**20,
                "composition MiB": composed[phase] / 2**20,
                "saved, in hidden-size bf16 tensors": (composed[phase] - fused[phase]) / hidden,
            }
            for phase in fused
        }
        for phase, row in rows[name].items():
            print(name, phase, {k: round(v, 2) for k, v in row.items()})

    def rebuilt_op_by_op(grad_y, y, weight, bias, index, columns, rstd, centered, offset):
        """The memory-sharing backward before its kernels rebuilt x_hat."""
        x_hat = norm_kernels.x_hat_from_output(y, weight, bias, offset, index, columns)
        return norm_kernels.norm_backward(grad_y, x_hat, rstd, weight, centered, offset)

    from_output = norm_ops.norm_backward_from_output
    for name, (norm, wrapper) in norms.items():

        def make_sharing(norm=norm, wrapper=wrapper):
            return wrapper(norm, None, cache=PackCache(), share_output=True)

        norm_ops.norm_backward_from_output = from_output
        fused = phase_peaks(make_sharing, x, grad)
        norm_ops.norm_backward_from_output = rebuilt_op_by_op
        composed = phase_peaks(make_sharing, x, grad)
        rows[f"{name}, memory-sharing"] = row = {
            "kernels MiB": fused["backward"] / 2**20,
            "composition MiB": composed["backward"] / 2**20,
            "saved, in hidden-size bf16 tensors": (composed["backward"] - fused["backward"])
            / hidden,
        }
        print(name, "memory-sharing backward", {k: round(v, 2) for k, v in row.items()})
    write_json(args.output, {"norms": rows})


if __name__ == "__main__":
    main()
