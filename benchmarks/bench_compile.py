"""hf_actq under torch.compile, side by side with the same model compiled unpatched.

For a tiny LLaMA and a tiny BERT (random weights, built from configs), for the unpatched model
and each recipe: graph breaks (``torch._dynamo.explain`` of the forward and loss), the bytes the
compiled graph keeps for backward (read from the autograd graph after the forward, as
``hf_actq.memory.graph_saved_bytes`` does for eager models), the same bytes eager, and the largest
relative difference between compiled and eager gradients (a deterministic codec, "blpa", stands in
for stochastic rounding, whose seeds the two paths draw differently around shared inputs).

    python benchmarks/bench_compile.py [--backend inductor] [--output results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings

import torch
from provenance import write_json

import hf_actq
from hf_actq import ActQConfig
from hf_actq.memory.meter import graph_saved_bytes

STOCK_CHECKPOINTING = "stock checkpointing"
RECIPES = {
    "unpatched": None,
    "fewbit": ActQConfig.from_recipe("fewbit"),
    "uniform": ActQConfig.from_recipe("uniform"),
    "uniform (blpa)": ActQConfig.from_recipe("uniform", codec="blpa"),
    "alam": ActQConfig.from_recipe("alam", adaptive=False),
    # Gradient checkpointing, stock and with packed layer inputs (the "checkpoint" recipe;
    # 8 bits there, so that the gradients compare closely).
    "stock checkpointing": STOCK_CHECKPOINTING,
    "checkpoint (8-bit)": ActQConfig.from_recipe("checkpoint", bits=8),
}


def tiny_llama(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        attn_implementation="sdpa",
    )  # fmt: skip
    ids = torch.randint(0, 256, (2, seq))
    # use_cache=False: with checkpointing on, transformers otherwise logs a warning, a graph break.
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids, "use_cache": False}


def tiny_bert(seq: int):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=seq, attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    ids = torch.randint(0, 256, (2, seq))
    return BertForSequenceClassification(config), {"input_ids": ids, "labels": torch.tensor([0, 1])}


def measure(base, batch, config, backend: str) -> dict:
    def patched():
        model = copy.deepcopy(base).train()
        if config == STOCK_CHECKPOINTING:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        elif config is not None:
            hf_actq.apply(model, config)
        return model

    def step(model, run):
        torch.manual_seed(1)
        loss = run(**batch).loss
        saved = graph_saved_bytes(loss, exclude=model.parameters())
        loss.backward()
        return saved, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    eager_model = patched()
    eager_saved, eager_grads = step(eager_model, eager_model)
    model = patched()
    explained = torch._dynamo.explain(lambda **b: model(**b).loss)(**batch)
    compiled = torch.compile(model, backend=backend)
    compiled_saved, compiled_grads = step(model, compiled)
    worst = max(
        ((eager_grads[n] - g).abs().max() / eager_grads[n].abs().max().clamp_min(1e-30)).item()
        for n, g in compiled_grads.items()
    )
    return {
        "graphs": explained.graph_count,
        "graph_breaks": explained.graph_break_count,
        "eager_saved_bytes": eager_saved,
        "compiled_saved_bytes": compiled_saved,
        "max_rel_grad_diff": worst,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rows = []
    for model_name, build in (("tiny llama", tiny_llama), ("tiny bert", tiny_bert)):
        base, batch = build(args.seq)
        for recipe, config in RECIPES.items():
            torch._dynamo.reset()
            row = {
                "model": model_name,
                "recipe": recipe,
                **measure(base, batch, config, args.backend),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        "\n| model | recipe | graphs | breaks | saved eager | saved compiled | vs unpatched compiled | max grad diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        stock = next(r for r in rows if r["model"] == row["model"] and r["recipe"] == "unpatched")
        print(
            f"| {row['model']} | {row['recipe']} | {row['graphs']} | {row['graph_breaks']} | "
            f"{row['eager_saved_bytes']:,} | {row['compiled_saved_bytes']:,} | "
            f"{row['compiled_saved_bytes'] / stock['compiled_saved_bytes']:.2f}x | "
            f"{row['max_rel_grad_diff']:.1e} |"
        )
    if args.output:
        write_json(args.output, {"backend": args.backend, "seq": args.seq, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
