import dataclasses

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig, SavedTensorMeter
from hf_actq.testing import tiny_llama

peft = pytest.importorskip("peft")


def _llama():
    return tiny_llama(hidden_size=64, intermediate_size=128)


def _lora(model):
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    return peft.get_peft_model(model, config)


def _step(model, ids):
    model.zero_grad()
    trainable = [p for p in model.parameters() if p.requires_grad]
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [p.grad.clone() for p in trainable], meter.nbytes


@pytest.mark.parametrize("order", ["after", "before"])
def test_lora_trains_with_fewer_bytes_and_close_gradients(order):
    ids = torch.randint(
        3, 100, (2, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    )
    reference = _lora(_llama())
    grads, nbytes = _step(reference, ids)
    if order == "after":
        model = _lora(_llama())
        handle = hf_actq.apply(model, bits=8)
    else:
        base = _llama()
        handle = hf_actq.apply(base, bits=8)
        model = _lora(base)
    assert any(".lora_A." in path for path in handle.patched) or order == "before"
    patched_grads, patched_bytes = _step(model, ids)
    # Applied before get_peft_model, the LoRA-wrapped down_proj runs as PEFT's module, unpatched
    # (with a warning): still fewer bytes, but not as few.
    assert patched_bytes < (nbytes / 2 if order == "after" else nbytes)
    flat = torch.cat([g.flatten() for g in grads])
    patched = torch.cat([g.flatten() for g in patched_grads])
    assert torch.nn.functional.cosine_similarity(flat, patched, dim=0) > 0.98
    handle.revert()
    assert _step(model, ids)[1] == nbytes


@pytest.mark.parametrize("order", ["after", "before"])
def test_lora_on_every_gated_mlp_projection_keeps_the_product_compressed(order, caplog):
    def lora_mlp(model):
        targets = ["gate_proj", "up_proj", "down_proj"]
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))

    ids = torch.randint(
        3, 100, (2, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    )
    grads, _ = _step(lora_mlp(_llama()), ids)
    unfused = lora_mlp(_llama())
    hf_actq.apply(unfused, bits=8, gated_mlp=False)
    _, unfused_bytes = _step(unfused, ids)
    if order == "after":
        model = lora_mlp(_llama())
        handle = hf_actq.apply(model, bits=8)
        mlps = [d for d in handle.patched.values() if d.startswith("gated_mlp")]
        assert len(mlps) == 2 and all("product" in d for d in mlps)
        assert any(".mlp.down_proj.lora_A." in path for path in handle.patched)
    else:
        base = _llama()
        hf_actq.apply(base, bits=8)
        model = lora_mlp(base)
    patched_grads, patched_bytes = _step(model, ids)
    assert patched_bytes < unfused_bytes
    assert ("gated product stays compressed" in caplog.text) == (order == "before")
    flat = torch.cat([g.flatten() for g in grads])
    patched = torch.cat([g.flatten() for g in patched_grads])
    assert torch.nn.functional.cosine_similarity(flat, patched, dim=0) > 0.98


def test_callback_patches_a_peft_model_and_trains_as_well_as_unpatched(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hf_actq import ActQCallback

    class Causal(torch.utils.data.Dataset):
        ids = torch.randint(
            3, 100, (4, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(0)
        )

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
    )

    def train(callbacks):
        model = _lora(_llama())
        frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
        trainer = Trainer(model=model, args=args, train_dataset=Causal(), callbacks=callbacks)
        trainer.train()
        assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    unpatched = train([])
    callback = ActQCallback(bits=4)
    patched = train([callback])
    assert any(".lora_A." in path for path in callback.handle.patched)
    assert len(callback.memory_history) == 12
    # The same first loss, up to the fused loss's rounding (chunked head matmul).
    assert patched[0] == pytest.approx(unpatched[0], rel=1e-6)
    drop = unpatched[0] - unpatched[-1]
    assert drop > 0.15 and abs(patched[-1] - unpatched[-1]) < 0.1 * drop


def _bf16_lora(dropout: float, **options):
    """A bf16 model whose LoRA adapters PEFT keeps in fp32: each adapter casts its input."""
    torch.manual_seed(0)
    model = _llama().to(torch.bfloat16)
    config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=dropout, **options)
    return peft.get_peft_model(model, config)


# Every slot exact but the LoRA inputs' own: what changes is only where they come from.
_EXACT = ActQConfig(
    bits=8, activations=False, norm=False, gated_mlp=False, attention=False, fused_loss=False
)
_EXACT_LORA = {"re:lora_[AB]": {"codec": "exact"}}


def _exact_step(model, ids):
    model.train()
    torch.manual_seed(3)  # the dropouts' seeds
    return _step(model, ids)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_adapters_of_one_input_keep_it_once_in_the_models_dtype(dropout, monkeypatch):
    """PEFT casts a bf16 input to each fp32 adapter's dtype, and drops out the cast: q, k and v's
    lora_A would each keep their own fp32 copy. The cast and the dropout are rebuilt from one
    kept bf16 input instead: the same gradients (exact slots), fewer bytes."""
    import hf_actq.integrations.layers as layers

    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    config = dataclasses.replace(_EXACT, slots=_EXACT_LORA)
    model = _bf16_lora(dropout)
    handle = hf_actq.apply(model, config)
    grads, nbytes = _exact_step(model, ids)
    handle.revert()
    with monkeypatch.context() as patch:
        patch.setattr(layers, "_share_lora_inputs", lambda *args: None)
        handle = hf_actq.apply(model, config)
        unshared_grads, unshared_bytes = _exact_step(model, ids)
        handle.revert()
    for got, want in zip(grads, unshared_grads):
        assert torch.equal(got, want)
    # q, k, v: one bf16 input kept, not three fp32 ones.
    assert nbytes < 0.7 * unshared_bytes, (nbytes, unshared_bytes)
    if dropout == 0.0:  # against the stock model, whose dropout draws other masks
        stock_grads, stock_bytes = _exact_step(model, ids)
        assert nbytes < stock_bytes
        # bf16 backward through the frozen base layers: rounding apart, the same gradients.
        for got, want in zip(grads, stock_grads):
            assert (got - want).norm() <= 2e-2 * want.norm()


def test_lora_adapters_take_the_norms_packed_output_and_the_gated_product():
    """With compressed norms, q/k/v's and gate/up's lora_A take the norm's packed output
    (offered) through PEFT's cast, and down_proj's lora_A the gated product rebuilt from the
    operands its op keeps: the step packs no input of theirs."""
    from hf_actq.ops import dedup

    packed_slots = []
    original = dedup.PackCache._packed

    def logged(watcher, slot, x, codec, seed):
        packed_slots.append(slot)
        return original(watcher, slot, x, codec, seed)

    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _bf16_lora(0.05)
    hf_actq.apply(model, ActQConfig.from_recipe("uniform", bits=4))
    model.train()
    dedup.PackCache._packed = staticmethod(logged)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        dedup.PackCache._packed = staticmethod(original)
    lora_a = [slot for slot in packed_slots if ".lora_A." in slot]
    # Layer 0's norm reads the frozen embeddings (nothing to offer): q_proj packs, k and v share.
    assert lora_a == [
        "model.layers.0.self_attn.q_proj.lora_A.default:input",
        "model.layers.0.self_attn.o_proj.lora_A.default:input",
        "model.layers.1.self_attn.o_proj.lora_A.default:input",
    ], lora_a


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_down_projections_lora_a_keeps_no_copy_of_the_gated_product(dropout, monkeypatch):
    """down_proj's lora_A takes the product act(gate) * up rebuilt from the packed operands (as
    the fused path's down projection does for its weight gradient) instead of packing the
    intermediate-size product again: fewer bytes, and gradients as close to the unpatched
    model's as with its own pack."""
    from hf_actq.ops import gated_mlp

    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    # lora_B random, not zero: lora_A's gradient (its input's only reader) is then not zero.
    model = _bf16_lora(dropout, init_lora_weights=False)
    config = ActQConfig.from_recipe("uniform", bits=4)
    stock, _ = _exact_step(model, ids)
    handle = hf_actq.apply(model, config)
    offered, offered_bytes = _exact_step(model, ids)
    handle.revert()
    with monkeypatch.context() as patch:
        patch.setattr(gated_mlp, "may_offer", lambda state: False)
        handle = hf_actq.apply(model, config)
        packed, packed_bytes = _exact_step(model, ids)
        handle.revert()
    # Two layers' 2 x 16 x 128 products at 4 bits, codes and metadata: 2 x 2 KiB, 8 bytes apart
    # (the one dropout seed tensor rebuilt from instead of a mask).
    assert packed_bytes - offered_bytes >= 2 * 2 * 16 * 128 // 2, (packed_bytes, offered_bytes)

    def cosine(grads, reference):
        flat = torch.cat([g.float().flatten() for g in grads])
        want = torch.cat([g.float().flatten() for g in reference])
        return torch.nn.functional.cosine_similarity(flat, want, dim=0).item()

    if dropout == 0.0:  # against the stock model, whose dropout would draw other masks
        assert cosine(offered, stock) > 0.97, cosine(offered, stock)
        assert cosine(offered, stock) > cosine(packed, stock) - 0.01
    assert cosine(offered, packed) > 0.97, cosine(offered, packed)


def test_the_checkpoint_recipe_refuses_prefix_tuning_in_one_line():
    """Stock checkpointing fails under prefix tuning with a raw attention-size error deep in
    SDPA; "checkpoint" turns it on, so it says why at apply, and the other recipes train."""
    model = peft.get_peft_model(
        _llama(), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )
    with pytest.raises(ValueError, match="prefix tuning"):
        hf_actq.apply(model, ActQConfig.from_recipe("checkpoint"))
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    handle = hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    model(input_ids=ids, labels=ids).loss.backward()
    handle.revert()
