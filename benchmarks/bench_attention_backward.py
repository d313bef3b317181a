"""Whether attention's backward could skip re-running its forward: gradient error of the two
backwards a compressed SDPA could run, on the q, k, v and output gradients of the pretrained
all-MiniLM-L6-v2 on real MRPC pairs (issue 69, "attention backward from the saved log-sum-exp").

    python benchmarks/bench_attention_backward.py [--glue-dir ../shared/glue_data]
        [--output benchmarks/results/bench_attention_backward.json]

The op today keeps packed q, k, v and in backward differentiates SDPA again on the unpacked
q̂, k̂, v̂ ("re-run": the forward runs twice). The fused kernels' own backward needs only q, k, v,
the output O and the per-row log-sum-exp (LSE, fp32, one value per query row): keeping LSE and
taking O from ``o_proj``'s pack would skip the second forward ("saved LSE"). Both are measured
here on the same packs, through SDPA's own backward node (the CPU flash kernel): in "saved LSE"
the node's saved q, k, v (and with "O packed", its output too) are replaced by their round trips
through the codec, while its LSE is the exact forward's. Each layer's q, k, v, mask and upstream
gradient come from one stock step (dropout 0), 32 pairs; the codec is "uniform"'s (AQ, groups of
one, stochastic rounding, the same seed for every path). Reported per bits and dtype: the relative
L2 error of the concatenated q, k, v gradients against the exact ones, mean over the 6 layers,
the ratio of each path's mean to re-run's, the median over layers of the per-layer ratio, and
each layer's largest |q kᵀ · scale|.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from provenance import write_json


def capture_layers(net, batch) -> list[dict]:
    """Each attention call's q, k, v, mask, options and output gradient in one step of ``net``
    (an SDPA model) on ``batch``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    layers: list[dict] = []

    def capturing(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        record = {"module": module, "qkv": (query, key, value), "mask": attention_mask}
        record["options"] = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        out.register_hook(lambda grad: record.__setitem__("grad", grad.detach()))
        layers.append(record)
        return out, weights

    AttentionInterface.register("bench_capture", capturing)
    # The padding mask: a name without a mask builder gets none.
    AttentionMaskInterface.register("bench_capture", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    net.set_attn_implementation("bench_capture")
    try:
        net(**batch).loss.backward()
    finally:
        net.set_attn_implementation("sdpa")
    for record in layers:
        record["qkv"] = tuple(t.detach() for t in record["qkv"])
    return layers


def gradients(record: dict, qkv, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v gradients (flattened, fp32) of SDPA at ``qkv``, and its output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    leaves = [t.to(dtype).requires_grad_() for t in qkv]
    out = sdpa_attention_forward(
        record["module"], *leaves, _mask(record, dtype), **record["options"]
    )[0]
    grads = torch.autograd.grad(out, leaves, record["grad"].to(dtype))
    return torch.cat([g.float().reshape(-1) for g in grads]), out.detach()


def _mask(record, dtype):
    mask = record["mask"]
    return mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)


def measure(layers: list[dict], bits_list=(8, 4, 3, 2), dtypes=("float32", "bfloat16")) -> dict:
    from hf_actq.codecs import uniform

    results: dict = {}
    nodes: set[str] = set()
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for bits in bits_list:
            codec = uniform(bits)

            def round_trip(t, seed, codec=codec):
                return codec.unpack(codec.pack(t.contiguous(), seed)).view(t.shape)

            errors: dict[str, list[float]] = {
                "re-run": [],
                "saved LSE": [],
                "saved LSE, O packed": [],
            }
            for index, record in enumerate(layers):
                exact, out = gradients(record, record["qkv"], dtype)
                # One seed per layer and tensor, shared by the three paths: the same packs.
                packs = [
                    round_trip(t.to(dtype), 1000 * index + i) for i, t in enumerate(record["qkv"])
                ]
                o_hat = round_trip(out, 1000 * index + 3)
                paths = {
                    "re-run": gradients(record, packs, dtype)[0],
                    "saved LSE": _saved_lse_backward(record, dtype, packs, None, nodes),
                    "saved LSE, O packed": _saved_lse_backward(record, dtype, packs, o_hat, nodes),
                }
                for name, got in paths.items():
                    errors[name].append(((got - exact).norm() / exact.norm()).item())
            row = {name: statistics.mean(values) for name, values in errors.items()}
            for name in ("saved LSE", "saved LSE, O packed"):
                row[f"{name} / re-run"] = row[name] / row["re-run"]
                ratios = [a / b for a, b in zip(errors[name], errors["re-run"])]
                row[f"{name} / re-run, median layer"] = statistics.median(ratios)
            results[f"{dtype_name}, {bits} bits"] = row
            print(dtype_name, bits, {k: round(v, 4) for k, v in row.items()}, flush=True)
    results["backward nodes"] = sorted(nodes)
    # What makes the LSE path fragile: scores far from zero, where a small change is a large
    # factor after exp.
    results["largest |score| per layer"] = [
        (q @ k.transpose(-1, -2) * r["options"]["scaling"]).abs().max().item()
        for r in layers
        for q, k, _ in [r["qkv"]]
    ]
    return results


def _saved_lse_backward(record, dtype, packs, o_hat, nodes: set) -> torch.Tensor:
    """The saved-LSE backward: SDPA run on exact q, k, v (so LSE is the exact one), its node
    reading ``packs`` for q, k, v and ``o_hat`` (if given) for its output."""
    from torch.autograd.graph import saved_tensors_hooks
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    leaves = [t.to(dtype).requires_grad_() for t in record["qkv"]]
    by_leaf = {id(leaf): p for leaf, p in zip(leaves, packs)}
    big = leaves[0].shape

    def pack(tensor):
        if id(tensor) in by_leaf:
            return by_leaf[id(tensor)]
        if o_hat is not None and tensor.dim() == 4 and tensor.shape == big:
            return o_hat.transpose(1, 2)  # transformers returns [batch, seq, heads, dim]
        if tensor.numel() >= big.numel() and tensor.shape != big:
            raise RuntimeError(f"SDPA saved a {tuple(tensor.shape)} tensor: not a fused backward")
        return tensor

    with saved_tensors_hooks(pack, lambda t: t):
        out = sdpa_attention_forward(
            record["module"], *leaves, _mask(record, dtype), **record["options"]
        )[0]
    nodes.add(_attention_node(out.grad_fn))
    grads = torch.autograd.grad(out, leaves, record["grad"].to(dtype))
    return torch.cat([g.float().reshape(-1) for g in grads])


def _attention_node(node) -> str:
    """The name of the first node below ``node`` whose name says attention (SDPA's own)."""
    seen, frontier = set(), [node]
    while frontier:
        node = frontier.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Attention" in type(node).__name__:
            return type(node).__name__
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return "none found"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glue-dir", default=os.path.join("..", "shared", "glue_data"))
    parser.add_argument("--output", default="benchmarks/results/bench_attention_backward.json")
    args = parser.parse_args(argv)
    from bench_gradients import minilm_batch, minilm_model

    net, batch = minilm_model(attn_implementation="sdpa"), minilm_batch(args.glue_dir)
    write_json(args.output, measure(capture_layers(net, batch)))


if __name__ == "__main__":
    main()
