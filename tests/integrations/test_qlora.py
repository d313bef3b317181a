"""QLoRA on CPU: bitsandbytes 4-bit (nf4) base, PEFT LoRA adapters, hf_actq on top."""

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaForCausalLM

import hf_actq
from hf_actq import SavedTensorMeter
from hf_actq.testing import tiny_llama

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _qlora(tmp_path, use_reentrant):
    tiny_llama(hidden_size=64, intermediate_size=128).save_pretrained(tmp_path)
    quantized = LlamaForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        ),
    )
    quantized = peft.prepare_model_for_kbit_training(
        quantized,
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
    )
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(quantized, lora)


def _saved_bytes(model, ids):
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return meter.nbytes


def _losses(model, ids, steps=12):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_qlora_trains_patched_as_well_as_unpatched(tmp_path, use_reentrant):
    ids = torch.randint(
        3, 100, (4, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    )
    unpatched = _losses(_qlora(tmp_path, use_reentrant), ids)
    model = _qlora(tmp_path, use_reentrant)
    model.gradient_checkpointing_disable()  # compare what one plain forward keeps
    baseline = _saved_bytes(model, ids)
    handle = hf_actq.apply(model, bits=4)
    assert any(".lora_A." in path for path in handle.patched)
    assert _saved_bytes(model, ids) < baseline
    model.zero_grad()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    patched = _losses(model, ids)
    # The frozen 4-bit base and the exact forward: the first loss is the unpatched one; after
    # 12 steps the loss (down by about 0.25) is within 10% of that drop (measured: 3.5%).
    assert patched[0] == unpatched[0]
    drop = unpatched[0] - unpatched[-1]
    assert drop > 0.15 and abs(patched[-1] - unpatched[-1]) < 0.1 * drop
    handle.revert()
