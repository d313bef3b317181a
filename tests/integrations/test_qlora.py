"""QLoRA on CPU: bitsandbytes 4-bit (nf4) base, PEFT LoRA adapters, hf_actq on top."""

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import hf_actq
from hf_actq import SavedTensorMeter

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _qlora(tmp_path, use_reentrant):
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
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


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_qlora_trains_patched(tmp_path, use_reentrant):
    model = _qlora(tmp_path, use_reentrant)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    model.gradient_checkpointing_disable()  # compare what one plain forward keeps
    baseline = _saved_bytes(model, ids)
    handle = hf_actq.apply(model, bits=4)
    assert any(".lora_A." in path for path in handle.patched)
    assert _saved_bytes(model, ids) < baseline
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    handle.revert()
