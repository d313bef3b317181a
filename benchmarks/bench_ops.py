"""Compressed ops vs the unmodified ones, side by side in one process.

Part 1, per op: bytes autograd keeps for backward (SavedTensorMeter, parameters excluded) and
forward+backward time (median of interleaved repeats), with ratios.
Part 2, a RoBERTa-base-shaped model built from config (fp32, batch 8, seq 128, dropout on, train
mode): every slot compressed (linear inputs, LayerNorm, attention q/k/v/probabilities at uniform
4-bit; GELU few-bit 4-bit; dropout masks from seeds), against the unpatched model.

    python benchmarks/bench_ops.py --output benchmarks/results/bench_ops.json

The models are patched with ``hf_actq.apply(model, ActQConfig(...))``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from provenance import write_json
from torch import nn

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.codecs import uniform
from hf_actq.ops import FewBitActivation
from hf_actq.ops.attention import (
    compressed_eager_attention,
)
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import CompressedDropout
from hf_actq.ops.linear import CompressedLinear
from hf_actq.ops.norm import CompressedLayerNorm


def _median_pair(fn_a, fn_b, repeats):
    a, b = [], []
    for _ in range(repeats):
        for fn, sink in ((fn_a, a), (fn_b, b)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def _saved(fn, exclude):
    with SavedTensorMeter(exclude=exclude) as meter:
        fn()
    return meter.nbytes


def op_rows(repeats):
    torch.manual_seed(0)
    x = torch.randn(8, 128, 768, requires_grad=True)
    codec = uniform(4)
    linear = nn.Linear(768, 3072)
    norm = nn.LayerNorm(768)
    cases = {
        "linear 768->3072": (linear, CompressedLinear(linear, codec, PackCache())),
        "layernorm 768": (norm, CompressedLayerNorm(norm, codec, PackCache())),
        "dropout p=0.1": (nn.Dropout(0.1), CompressedDropout(0.1)),
        "gelu (few-bit 4)": (nn.GELU(), FewBitActivation("gelu", 4)),
    }
    rows = []
    for name, (base, ours) in cases.items():
        params = list(base.parameters())

        def run(module):
            return lambda: module(x).sum().backward()

        base_bytes = _saved(lambda base=base: base(x), params)
        our_bytes = _saved(lambda ours=ours: ours(x), params)
        run(base)()
        run(ours)()
        t_base, t_ours = _median_pair(run(base), run(ours), repeats)
        rows.append((name, base_bytes, our_bytes, t_base, t_ours))

    q, k, v = (torch.randn(8, 12, 128, 64, requires_grad=True) for _ in range(3))
    holder = nn.Module()
    codecs = dict.fromkeys(("q", "k", "v", "probs"), codec)
    from transformers.models.bert.modeling_bert import eager_attention_forward

    def base_attn():
        return eager_attention_forward(holder, q, k, v, None, dropout=0.1)[0]

    def our_attn():
        return compressed_eager_attention(holder, q, k, v, None, dropout=0.1, codecs=codecs)[0]

    base_bytes, our_bytes = _saved(base_attn, []), _saved(our_attn, [])
    t_base, t_ours = _median_pair(
        lambda: base_attn().sum().backward(), lambda: our_attn().sum().backward(), repeats
    )
    rows.append(("attention 12x128x64", base_bytes, our_bytes, t_base, t_ours))
    return rows


def roberta_base(batch, seq, actq):
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(attn_implementation="eager")  # roberta-base shapes, dropout 0.1
    torch.manual_seed(0)
    baseline = RobertaForSequenceClassification(config).train()
    patched = copy.deepcopy(baseline)
    hf_actq.apply(patched, actq)
    ids = torch.randint(3, config.vocab_size, (batch, seq))
    labels = torch.randint(0, 2, (batch,))
    result = {}
    for name, model in (("baseline", baseline), ("hf_actq", patched)):
        meter = SavedTensorMeter(exclude=list(model.parameters()), model=model)
        with meter:
            loss = model(input_ids=ids, labels=labels).loss
        by_kind: dict[str, int] = {}
        for path, nbytes in meter.by_module().items():
            kind = path.rsplit(".", 1)[-1] if path else "(outside modules)"
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
        loss.backward()
        result[name] = {"saved_bytes": meter.nbytes, "by_module_kind": by_kind}
    result["ratio"] = result["baseline"]["saved_bytes"] / result["hf_actq"]["saved_bytes"]
    return result


def llama_blocks(batch, seq, actq, layers=2):
    """LLaMA-style decoder layers in bf16 (LLaMA2-7B proportions at 1/4 width), SDPA baseline."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=1024,
        intermediate_size=2752,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    baseline = LlamaModel(config).to(torch.bfloat16).train()
    patched = copy.deepcopy(baseline)
    hf_actq.apply(patched, actq)
    ids = torch.randint(0, 1000, (batch, seq))
    result = {}
    for name, model in (("baseline", baseline), ("hf_actq", patched)):
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            hidden = model(input_ids=ids).last_hidden_state
        hidden.float().pow(2).mean().backward()
        result[name] = {"saved_bytes": meter.nbytes}
    result["ratio"] = result["baseline"]["saved_bytes"] / result["hf_actq"]["saved_bytes"]
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--llama-batch", type=int, default=4)
    parser.add_argument("--llama-seq", type=int, default=512)
    parser.add_argument("--output")
    args = parser.parse_args(argv)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'op':24s} {'saved, torch':>13s} {'saved, ours':>12s} {'smaller':>8s} {'f+b time':>9s}")
    rows = op_rows(args.repeats)
    for name, base_bytes, our_bytes, t_base, t_ours in rows:
        smaller = f"{base_bytes / our_bytes:7.1f}x" if our_bytes >= 1024 else "    seed"
        print(
            f"{name:24s} {base_bytes / 2**20:9.2f} MiB {our_bytes / 2**20:8.2f} MiB "
            f"{smaller} {t_ours / t_base:8.2f}x"
        )

    model = {}
    for label, config in (
        ("uniform 4-bit, 4-bit few-bit GELU, 1-bit masks", ActQConfig(bits=4, dropout_mode="mask")),
        ("uniform 4-bit, 4-bit few-bit GELU, seeded masks", ActQConfig(bits=4)),
        (
            "AQ 0.5-bit (G=4, b=2), 1-bit few-bit GELU, seeded masks",
            ActQConfig(codec="aq", bits=0.5, activation_bits=1),
        ),
    ):
        result = roberta_base(args.batch, args.seq, config)
        model[label] = result
        base, ours = result["baseline"]["saved_bytes"], result["hf_actq"]["saved_bytes"]
        print(
            f"\nroberta-base shapes, fp32, batch {args.batch}, seq {args.seq}, train, {label}:\n"
            f"  baseline {base / 2**20:.1f} MiB, hf_actq {ours / 2**20:.1f} MiB, "
            f"{result['ratio']:.2f}x smaller"
        )
    llama = {}
    for label, config in (
        (
            "AQ 0.5-bit (G=4, b=2) on every slot, 1-bit few-bit SiLU",
            ActQConfig(codec="aq", bits=0.5, activation_bits=1),
        ),
        ("uniform 4-bit on every slot, 4-bit few-bit SiLU", ActQConfig(bits=4)),
    ):
        result = llama_blocks(args.llama_batch, args.llama_seq, config)
        llama[label] = result
        base, ours = result["baseline"]["saved_bytes"], result["hf_actq"]["saved_bytes"]
        print(
            f"\nLLaMA-style decoder (2 layers, hidden 1024, intermediate 2752), bf16, batch "
            f"{args.llama_batch}, seq {args.llama_seq}, {label}:\n"
            f"  baseline {base / 2**20:.1f} MiB, hf_actq {ours / 2**20:.1f} MiB, "
            f"{result['ratio']:.2f}x smaller"
        )
    if args.output:
        names = ("op", "saved_torch", "saved_ours", "s_torch", "s_ours")
        ops = [dict(zip(names, r)) for r in rows]
        write_json(args.output, {"ops": ops, "roberta_base": model, "llama_blocks": llama})
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
