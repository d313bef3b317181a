"""A Qwen3-MoE block's step with PEFT's LoRA on its experts' 3-D weights (``target_parameters``,
what "all-linear" becomes under transformers 5): unpatched, and hf_actq's experts op with the
LoRA weights folded again in backward against taken as base plus the rank-r path
(``moe_routing.LowRankWeight``), side by side in one run.

    python benchmarks/bench_moe_lora.py --output benchmarks/results/bench_moe_lora.json

PEFT folds ``base + scaling * lhs @ rhs`` into a merged copy of the experts' weights each
forward; autograd then forms the merged weight's full [experts, out, in] gradient and reduces it
to the factors'. The rank-r path gives the factors their gradients from r-wide products and
never folds again in backward. Reported per mode: the step's time (median of interleaved
rounds, one thread), the backward's peak bytes above the forward's end (the CPU allocator's
events, ``hf_actq.memory.PeakMemory``) and the bytes autograd keeps (``SavedTensorMeter``,
parameters excluded). fp32 on the CPU by default; on a GPU: ``--device cuda --dtype bfloat16``
(the step timed between synchronizations, the peaks from the caching allocator).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from provenance import write_json


def make_block(args):
    """The MoE block of a one-layer Qwen3-MoE with LoRA of rank ``args.rank`` on its experts."""
    import peft
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        intermediate_size=args.intermediate,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    model = Qwen3MoeForCausalLM(config).to(args.device, getattr(torch, args.dtype))
    lora = peft.LoraConfig(
        r=args.rank,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    return peft.get_peft_model(model, lora).train()


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, model, x, grad) -> tuple[float, dict]:
    """One step of the block in ``mode``: its seconds, and (once) its bytes."""
    from hf_actq import SavedTensorMeter
    from hf_actq.memory.peak import PeakMemory

    block = model.base_model.model.model.layers[0].mlp
    params = list(model.parameters())
    for p in params:
        p.grad = None
    leaf = x.clone().requires_grad_()
    synchronize(x.device)
    start = time.perf_counter()
    with SavedTensorMeter(exclude=params) as meter:
        out = block(leaf)
    out.backward(grad)
    synchronize(x.device)
    seconds = time.perf_counter() - start
    for p in params:
        p.grad = None
    leaf = x.clone().requires_grad_()
    with PeakMemory(x.device, phase="forward") as peak:
        out = block(leaf)
        peak.mark("backward")
        out.backward(grad)
        del out
    return seconds, {"saved_bytes": meter.nbytes, **peak.phase_peaks}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/bench_moe_lora.json")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)

    import hf_actq
    from hf_actq.ops import moe_routing

    torch.manual_seed(1)
    x, grad = (
        torch.randn(1, args.tokens, args.hidden).to(args.device, getattr(torch, args.dtype))
        for _ in range(2)
    )
    models = {"unpatched": make_block(args)}
    for mode in ("folded again", "rank-r path"):
        models[mode] = make_block(args)
        hf_actq.apply(models[mode], hf_actq.ActQConfig.from_recipe("uniform", bits=4))
    low_rank = moe_routing.RefoldedWeight.low_rank

    def step(mode):
        # "folded again": the path a trained base takes (and every LoRA before the rank-r path).
        moe_routing.RefoldedWeight.low_rank = (
            (lambda self: None) if mode == "folded again" else low_rank
        )
        try:
            return run_mode(mode, models[mode], x, grad)
        finally:
            moe_routing.RefoldedWeight.low_rank = low_rank

    times = {mode: [] for mode in models}
    measured = {}
    for mode in models:  # a warm-up round each, which also measures the bytes
        measured[mode] = step(mode)[1]
    for _ in range(args.rounds):
        for mode in models:
            times[mode].append(step(mode)[0])
    base = statistics.median(times["unpatched"])
    results = {}
    for mode in models:
        seconds = statistics.median(times[mode])
        results[mode] = {
            "step_ms": round(1e3 * seconds, 1),
            "step_vs_unpatched": round(seconds / base, 3),
            **measured[mode],
        }
        print(
            f"{mode:>13}: step {1e3 * seconds:7.1f} ms ({seconds / base:.2f}x), "
            f"saved {measured[mode]['saved_bytes'] / 2**20:7.2f} MiB, backward peak "
            f"{measured[mode]['backward'] / 2**20:7.2f} MiB"
        )
    write_json(args.output, {"shapes": vars(args) | {"output": None}, "results": results})


if __name__ == "__main__":
    main()
