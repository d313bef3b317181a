"""Run by test_accelerate.py under ``accelerate launch`` (and imported by it for the
single-process reference): train a tiny patched LLaMA on a fixed sequence of global batches, each
rank on its share, and write each rank's losses, the updated weights and the rounding codes the
rank draws for one fixed tensor.

    accelerate launch --multi_gpu ... accelerate_script.py OUT_DIR {ddp,fsdp2} {before,after} [RECIPE]
    accelerate launch --multi_gpu ... accelerate_script.py OUT_DIR trainer RECIPE...

"ddp" wraps the model with ``accelerator.prepare``; "fsdp2" shards it with torch's
``fully_shard`` (accelerate runs DDP on CPU even when asked for FSDP, so the sharding is done
here, on the gloo group accelerate set up). "before" applies hf_actq before wrapping (as
ActQCallback does), "after" to the wrapped or sharded model. RECIPE names a config of CONFIGS
("uniform" by default; "checkpoint": packed activation checkpointing, whose recompute runs inside
the backward of each DDP bucket's or FSDP unit's layer).
"""

import sys

import torch

import hf_actq
from hf_actq.codecs import uniform
from hf_actq.ops.dedup import PackCache
from hf_actq.testing import CausalRows, leave_launched_process, short_training, tiny_llama

STEPS = 3
GLOBAL_BATCH = 4
CONFIGS = {
    "uniform": hf_actq.ActQConfig(bits=4),
    "checkpoint": hf_actq.ActQConfig.from_recipe("checkpoint", bits=8),
    "checkpoint-4": hf_actq.ActQConfig.from_recipe("checkpoint"),
}
CONFIG = CONFIGS["uniform"]


def build_model():
    return tiny_llama()


def global_batches():
    generator = torch.Generator(torch.get_default_device()).manual_seed(1)
    return [torch.randint(3, 100, (GLOBAL_BATCH, 16), generator=generator) for _ in range(STEPS)]


def train(model, optimizer, rank, world, backward=None):
    """Losses of STEPS steps on this rank's share of each global batch (equal token counts, so
    the mean of the ranks' losses and gradients is the global batch's)."""
    share = GLOBAL_BATCH // world
    losses = []
    torch.manual_seed(2)  # Trainer seeds every rank alike; the rounding seeds still differ
    for ids in global_batches():
        ids = ids[rank * share : (rank + 1) * share]
        loss = model(input_ids=ids, labels=ids).loss
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def rounding_codes():
    """The 2-bit codes this process draws for one fixed tensor after the same manual seed."""
    torch.manual_seed(3)
    x = torch.linspace(-1, 1, 256)
    return PackCache().pack(x, uniform(2)).tensors[0]


def full_weights(model):
    # FSDP2 shards parameters as DTensors; gathering is a collective every rank joins.
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def main(out_dir, mode, when, recipe="uniform"):
    from accelerate import Accelerator

    config = CONFIGS[recipe]
    accelerator = Accelerator()
    model = build_model()
    if when == "before":
        handle = hf_actq.apply(model, config)
    backward = accelerator.backward
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (accelerator.num_processes,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        backward = None
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = accelerator.prepare(model, optimizer)
    if when == "after":
        handle = hf_actq.apply(model, config)
    losses = train(model, optimizer, accelerator.process_index, accelerator.num_processes, backward)
    # Each rank calibrates on its own examples; the sensitivities are averaged across ranks, so
    # every rank must arrive at the same plan.
    ids = global_batches()[0][accelerator.process_index :: accelerator.num_processes]
    plan = None
    if not handle.checkpointed:  # the adaptive pass does not run under packed checkpointing
        plan = handle.calibrate({"input_ids": ids, "labels": ids}, target_bits=1).slots
    record = {
        "checkpointed": sorted(handle.checkpointed),
        "plan": plan,
        "world": accelerator.num_processes,
        "sharded": any(hasattr(p, "full_tensor") for p in model.parameters()),
        "patched": handle.patched,
        "losses": losses,
        "weights": full_weights(accelerator.unwrap_model(model)),
        "codes": rounding_codes(),
    }
    torch.save(record, f"{out_dir}/rank{accelerator.process_index}.pt")
    # Tear the gloo group down while both ranks are alive (then leave_launched_process).
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def trainer_main(out_dir, *recipes):
    """``Trainer`` with ``ActQCallback`` under DDP, one run per recipe ("stock": no callback),
    with Trainer's own ``ddp_find_unused_parameters`` (decided before the callback patches)."""
    from transformers import Trainer

    record = {}
    for recipe in recipes:
        args = short_training(f"{out_dir}/{recipe}")
        callbacks = [] if recipe == "stock" else [hf_actq.ActQCallback(CONFIGS[recipe])]
        model = build_model()
        trainer = Trainer(model=model, args=args, train_dataset=CausalRows(), callbacks=callbacks)
        trainer.train()
        record[recipe] = {
            "world": args.world_size,
            "wrapper": type(trainer.model_wrapped).__name__,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weights": full_weights(model),
        }
    rank = trainer.accelerator.process_index
    torch.save(record, f"{out_dir}/rank{rank}.pt")
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2] == "trainer":
        trainer_main(sys.argv[1], *sys.argv[3:])
    else:
        main(*sys.argv[1:5])
    leave_launched_process()
