"""Run by test_deepspeed.py on two processes (gloo, DeepSpeed's CPU accelerator), and imported
by it for the single-process references.

    torchrun --nproc_per_node 2 deepspeed_script.py OUT_DIR engine [MODEL_TYPE]

``engine``: for ZeRO stages 2 and 3 (every parameter sharded under 3) and every case of
``CASES`` (only "uniform" for another ``MODEL_TYPE`` of ``hf_actq.testing.tiny_model``), a tiny
LLaMA (or that model) is patched, wrapped by ``deepspeed.initialize`` and takes one forward
and backward on this rank's half of a global batch; each rank writes the full gradient of every
parameter (``safe_get_full_grad``) per case. Each case runs twice: with the recipe's codecs and
with every codec made exact (:func:`make_exact`), whose gradient is deterministic and must equal
one process's on the whole batch.

    accelerate launch --use_deepspeed ... deepspeed_script.py OUT_DIR trainer RECIPE...

``trainer``: ``Trainer`` with ``ActQCallback`` under the ZeRO stage accelerate's launcher
sets, a few steps per recipe; each rank writes the losses, the logged activation memory and the
trained weights.
"""

import functools
import sys

import torch

import hf_actq
from hf_actq.codecs.packed import ExactCodec
from hf_actq.ops.packed_checkpoint import packed_checkpoint
from hf_actq.ops.state import STATE
from hf_actq.testing import (
    CausalRows,
    leave_launched_process,
    short_training,
    tiny_llama,
    tiny_model,
)

GLOBAL_BATCH = 4
# (recipe, checkpointing the user turns on besides): HF's reentrant checkpointing runs its first
# pass under no_grad (the stock forward) and its recompute through the fused ops.
CASES = (
    ("fewbit", None),
    ("uniform", None),
    ("alam", None),
    ("checkpoint", None),
    ("uniform", "reentrant"),
    ("uniform", "non-reentrant"),
)


def case_name(recipe: str, checkpointing: str | None) -> str:
    return recipe if checkpointing is None else f"{recipe}+{checkpointing}"


def config_of(recipe: str):
    # "alam" spread evenly: its calibration is the Trainer run's to test.
    extra = {"adaptive": False} if recipe == "alam" else {}
    return hf_actq.ActQConfig.from_recipe(recipe, **extra)


def make_exact(model, handle) -> None:
    """Every codec of the patched model exact, packed checkpoints included: the same fused ops
    and recomputes, with no rounding (the few-bit derivative codes are deterministic anyway)."""
    for module in model.modules():
        state = module.__dict__.get(STATE)
        if state is not None:
            for slot in state.codecs:
                state.codecs[slot] = ExactCodec()
    for layer in handle.checkpointed.values():
        layer._gradient_checkpointing_func = functools.partial(
            packed_checkpoint, codec=ExactCodec(), layer=layer
        )


def build(recipe: str, checkpointing: str | None, exact: bool, model_type: str = "llama"):
    model = (tiny_llama() if model_type == "llama" else tiny_model(model_type)).train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    handle = hf_actq.apply(model, config_of(recipe)) if recipe != "stock" else None
    if exact:
        make_exact(model, handle)
    return model


def global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, 100, (GLOBAL_BATCH, 16), generator=generator)


def single_process_gradients(
    recipe: str, checkpointing: str | None, exact: bool, model_type: str = "llama"
) -> dict:
    """One process's gradient on the whole global batch (the same token count on each half, so
    the ranks' mean gradient is this)."""
    model = build(recipe, checkpointing, exact, model_type)
    ids = global_batch()
    torch.manual_seed(2)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _engine(rank: int, world: int, out_dir: str, model_type: str = "llama") -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    share = GLOBAL_BATCH // world
    ids = global_batch()[rank * share : (rank + 1) * share]
    record = {}
    for stage in (2, 3):
        for recipe, checkpointing in CASES if model_type == "llama" else [("uniform", None)]:
            for exact in (True, False):
                model = build(recipe, checkpointing, exact, model_type)
                config = {
                    "train_micro_batch_size_per_gpu": share,
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                    "zero_allow_untested_optimizer": True,
                }
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
                sharded = any(p.numel() == 0 for p in engine.module.parameters())
                torch.manual_seed(2 + rank)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                grads = {
                    name: safe_get_full_grad(p).detach().clone()
                    for name, p in engine.module.named_parameters()
                }
                key = (stage, case_name(recipe, checkpointing), exact)
                record[key] = {"loss": loss.item(), "grads": grads, "sharded": sharded}
                engine.destroy()
    torch.save(record, f"{out_dir}/rank{rank}.pt")


def zero_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def trainer_config(recipe: str, plan_path: str | None):
    """The config of a Trainer recipe: None for "stock", "alam" with ``plan_path`` for
    "alam-plan"."""
    if recipe == "stock":
        return None
    if recipe == "alam-plan":
        return hf_actq.ActQConfig.from_recipe("alam", plan=plan_path)
    return hf_actq.ActQConfig.from_recipe(recipe)


def train_recipes(out_dir: str, stage: str | None, recipes, plan: str | None = None) -> dict:
    """Train with ``Trainer`` and ``ActQCallback`` per recipe. ``stage``: "launcher"
    (``accelerate launch --use_deepspeed`` gave the config), a ZeRO stage for
    ``TrainingArguments(deepspeed=...)``, or None (no DeepSpeed: one process, the reference).
    "alam-plan" reads ``plan`` (default: ``plan.json`` in ``out_dir``)."""
    import deepspeed
    from transformers import Trainer

    deepspeed_config = None if stage in (None, "launcher") else zero_config(int(stage))
    record = {}
    for recipe in recipes:
        model = tiny_llama()
        args = short_training(
            f"{out_dir}/{recipe}",
            # On a CPU, DeepSpeed takes the launch's process group only with use_cpu and gloo.
            ddp_backend=None if stage is None else "gloo",
            deepspeed=deepspeed_config,
            gradient_checkpointing=recipe == "uniform",  # reentrant, Trainer's default
        )
        config = trainer_config(recipe, plan or f"{out_dir}/plan.json")
        callbacks = [] if config is None else [hf_actq.ActQCallback(config)]
        trainer = Trainer(model=model, args=args, train_dataset=CausalRows(), callbacks=callbacks)
        entry = {"world": args.world_size, "engine": None}
        record[recipe] = entry
        try:
            trainer.train()
        except NotImplementedError as error:
            entry["error"] = str(error)
            continue
        entry["engine"] = type(trainer.model_wrapped).__name__
        entry["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        params = list(model.parameters())
        entry["sharded"] = any(p.numel() == 0 for p in params)
        with deepspeed.zero.GatheredParameters(params):
            entry["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if callbacks:
            entry["memory"] = [m["activation_bytes"] for m in callbacks[0].memory_history]
            installed = callbacks[0].handle.plan
            entry["plan"] = None if installed is None else installed.slots
    return record


def main(out_dir: str, mode: str, *rest: str) -> None:
    import deepspeed

    # DeepSpeed's CPU backend compiles its shared-memory all-reduce (C++, for its inference
    # path's inference_all_reduce) when the backend starts, in every new environment: 30 s of
    # g++ on CI's fresh one, for an op nothing here calls (ZeRO reduces through gloo).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if mode == "engine":
        _engine(rank, world, out_dir, *rest)
    elif mode == "trainer":
        record = train_recipes(out_dir, rest[0], rest[1:])
        torch.save(record, f"{out_dir}/rank{rank}.pt")
    else:
        raise ValueError(f"unknown mode {mode!r}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    leave_launched_process()
