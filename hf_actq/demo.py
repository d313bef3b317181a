"""The embedded demo: train a tiny BERT side by side with exact and few-bit GELU.

``hf-actq demo`` (or ``python -m hf_actq``) builds a small BERT classifier from a config (random
weights, no downloads), trains two identical copies on the same synthetic task, one with its GELU
activations made few-bit, and prints the bytes autograd holds for
backward (whole model and GELU slots) and the training losses of both runs. The few-bit copy
is made with ``hf_actq.apply`` and the "fewbit" recipe.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from hf_actq.config import ActQConfig
from hf_actq.integrations.transformers import apply
from hf_actq.memory import SavedTensorMeter
from hf_actq.report.cli import Parser, positive_int
from hf_actq.report.presets import preset_config

MAX_SEQ_LEN = 256  # the tiny BERT's position embeddings


def tiny_bert(seed: int = 0):
    from transformers import BertForSequenceClassification

    config = preset_config("tiny-bert")
    config.max_position_embeddings, config.num_labels = MAX_SEQ_LEN, 2
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def synthetic_batches(steps: int, batch_size: int, seq_len: int, seed: int = 0):
    """Label = whether the first token is one of the 16 "positive" ids 8..23; CPU tensors
    whatever torch's default device, the same batches everywhere."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(24, 512, (batch_size, seq_len), generator=generator, device="cpu")
        labels = torch.randint(0, 2, (batch_size,), generator=generator, device="cpu")
        positives = torch.randint(8, 24, (batch_size,), generator=generator, device="cpu")
        ids[:, 0] = torch.where(labels.bool(), positives, ids[:, 0])
        yield ids, labels


def measure(model, ids, labels):
    meter = SavedTensorMeter(exclude=list(model.parameters()), model=model)
    with meter:
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    model.zero_grad()
    act_bytes = sum(
        nbytes for path, nbytes in meter.by_module().items() if path.endswith("intermediate_act_fn")
    )
    return meter.nbytes, act_bytes


def train(model, steps, batch_size, seq_len, lr=1e-3):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids, labels in synthetic_batches(steps, batch_size, seq_len):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run(bits: int = 3, steps: int = 40, batch_size: int = 16, seq_len: int = 128) -> dict:
    baseline = tiny_bert()
    # Dropout off so that both runs see identical forward passes and differ only in backward.
    baseline.config.hidden_dropout_prob = 0.0
    for module in baseline.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    fewbit = copy.deepcopy(baseline)
    # Few-bit GELU alone (no memory-sharing norms), so the saving is the derivative's alone.
    handle = apply(fewbit, ActQConfig.from_recipe("fewbit", bits=bits, share_norm_outputs=False))
    patched = [path for path, what in handle.patched.items() if what.startswith("activation")]

    ids, labels = next(synthetic_batches(1, batch_size, seq_len, seed=123))
    base_total, base_act = measure(baseline, ids, labels)
    few_total, few_act = measure(fewbit, ids, labels)

    torch.manual_seed(0)
    base_losses = train(baseline, steps, batch_size, seq_len)
    torch.manual_seed(0)
    few_losses = train(fewbit, steps, batch_size, seq_len)
    return {
        "bits": bits,
        "patched": patched,
        "saved_bytes": {"baseline": base_total, "fewbit": few_total},
        "activation_slot_bytes": {"baseline": base_act, "fewbit": few_act},
        "losses": {"baseline": base_losses, "fewbit": few_losses},
    }


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def _bounded(low: int, high: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer in {low}..{high} ({what}), got {text!r}"
            )
        return value

    return parse


def main(argv=None) -> int:
    parser = Parser(prog="hf-actq demo", description=__doc__)
    parser.add_argument(
        "--bits", type=_bounded(1, 4, "few-bit derivatives"), default=3, help="1..4"
    )
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument(
        "--seq-len",
        type=_bounded(1, MAX_SEQ_LEN, "the tiny BERT's positions"),
        default=128,
        help=f"1..{MAX_SEQ_LEN}",
    )
    args = parser.parse_args(argv)
    result = run(args.bits, args.steps, args.batch_size, args.seq_len)

    saved, act = result["saved_bytes"], result["activation_slot_bytes"]
    print(
        f"tiny BERT (2 layers, hidden 128, intermediate 512), batch {args.batch_size}, "
        f"seq {args.seq_len}, fp32; few-bit activations at {args.bits} bits in "
        f"{len(result['patched'])} modules"
    )
    print("bytes autograd holds for backward (one forward pass, parameters excluded):")
    print(f"  {'':24s} {'baseline':>12s} {'few-bit':>12s} {'ratio':>7s}")
    for label, pair in (("GELU slots", act), ("whole model", saved)):
        ratio = pair["baseline"] / max(pair["fewbit"], 1)
        print(f"  {label:24s} {_mib(pair['baseline'])} {_mib(pair['fewbit'])} {ratio:6.2f}x")
    saved_pct = 100 * (1 - saved["fewbit"] / saved["baseline"])
    print(f"  activation memory saved: {saved_pct:.1f}%")
    losses = result["losses"]
    print(f"training loss on a synthetic task, {args.steps} AdamW steps (same init and data):")
    every = max(1, args.steps // 6)
    for step in list(range(0, args.steps, every)) + [args.steps - 1]:
        print(
            f"  step {step + 1:4d}   baseline {losses['baseline'][step]:.4f}   "
            f"few-bit {losses['fewbit'][step]:.4f}"
        )
    return 0
