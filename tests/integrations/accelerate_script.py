"""Run by test_accelerate.py under ``accelerate launch``: train a tiny patched LLaMA with DDP and
write what each rank patched and its losses."""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import hf_actq


def main(out_dir):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    handle = hf_actq.apply(model, bits=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    losses = []
    for _ in range(3):
        ids = torch.randint(3, 100, (2, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = accelerator.unwrap_model(model).model.layers[0].mlp.down_proj.weight
    record = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "patched": handle.patched,
        "losses": losses,
        "weight_sum": weight.double().sum().item(),
    }
    with open(f"{out_dir}/rank{accelerator.process_index}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
