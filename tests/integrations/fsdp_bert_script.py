"""Run by ``test_accelerate.py`` under ``accelerate launch`` (2 CPU processes):

    accelerate launch --multi_gpu ... fsdp_bert_script.py OUT_DIR [MODEL_TYPE]

A tiny BERT under "uniform" 8 bits with every encoder layer sharded by FSDP2 (``fully_shard``):
a post-LN BERT's last LayerNorm of each layer feeds the next layer's q, k, v, so the compressed
norm's output is shared across FSDP units. Every rank runs the whole batch once sharded and once
on an unsharded copy (the same global seed), and saves both losses and gradients. With
``MODEL_TYPE``, that tiny decoder (``hf_actq.testing.tiny_model``) instead, every codec exact
(the two runs must then agree to rounding), each decoder layer sharded.
"""

import copy
import sys

import torch

import hf_actq
from hf_actq.testing import leave_launched_process, tiny_bert, tiny_model


def main(out_dir, model_type=None):
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    accelerator = Accelerator()
    if model_type is None:
        model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        layers = model.bert.encoder.layer
    else:
        from deepspeed_script import make_exact  # beside this script

        model = tiny_model(model_type)
        layers = model.model.layers
    handle = hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform", bits=8))
    if model_type is not None:
        make_exact(model, handle)
    ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 0, 1]) if model_type is None else ids
    batch = dict(input_ids=ids, labels=labels)
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    reference_loss = reference(**batch).loss
    reference_loss.backward()

    # The linear-attention mixers (Qwen3.5) run again in backward, not stock: counted.
    from hf_actq.ops import recomputed_mixer

    recomputes = []
    checkpoint = recomputed_mixer.packed_checkpoint
    recomputed_mixer.packed_checkpoint = lambda *a, **k: recomputes.append(1) or checkpoint(*a, **k)

    mesh = init_device_mesh("cpu", (accelerator.num_processes,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(5)
    loss = model(**batch).loss
    loss.backward()
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for name, p in model.named_parameters()
    }
    record = {
        "losses": (loss.item(), reference_loss.item()),
        "grads": grads,
        "reference": {n: p.grad.clone() for n, p in reference.named_parameters()},
        "sharded": any(hasattr(p, "full_tensor") for p in model.parameters()),
        "norms": sum(d.startswith("norm") for d in handle.patched.values()),
        "mixers": sum(recomputed_mixer.is_recomputed_mixer(m) for m in model.modules()),
        "recomputes": len(recomputes),
    }
    torch.save(record, f"{out_dir}/rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    leave_launched_process()
