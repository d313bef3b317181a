import logging

import pytest
import torch
from tiny_models import tiny_llama as _llama
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)

from hf_actq import ActQCallback, SavedTensorMeter


class Toy(torch.utils.data.Dataset):
    def __init__(self, causal: bool, n: int = 32):
        generator = torch.Generator(torch.get_default_device()).manual_seed(0)
        self.ids = torch.randint(3, 100, (n, 16), generator=generator)
        self.labels = self.ids if causal else (self.ids[:, 0] % 2)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _args(tmp_path, **extra):
    return TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        **extra,
    )


def _bert(dropout=0.1):
    torch.manual_seed(0)
    return BertForSequenceClassification(
        BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
    )


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_tracks(patched, unpatched, tolerance=0.1):
    # No dropout, so the forward is exact and the first loss is the unpatched one (to 1 ulp: a
    # decoder's fused linear + cross-entropy sums its token chunks in another order, which some
    # CPUs round differently); the last is within ``tolerance`` of how far the unpatched loss fell.
    assert patched[0] == pytest.approx(unpatched[0], rel=1e-6, abs=0)
    drop = unpatched[0] - unpatched[-1]
    assert drop > 0.5
    assert abs(patched[-1] - unpatched[-1]) < tolerance * drop


def _trained_losses(tmp_path, make_model, causal, callback=None, **extra):
    args = _args(tmp_path, **extra)
    args.max_steps, args.learning_rate = 12, 1e-2
    trainer = Trainer(
        model=make_model(),
        args=args,
        train_dataset=Toy(causal, n=8 if causal else 4),
        callbacks=[callback] if callback else [],
    )
    trainer.train()
    return _losses(trainer), trainer


def test_trainer_with_callback_tracks_the_unpatched_loss_on_a_tiny_bert(tmp_path):
    def bert():
        return _bert(dropout=0.0)

    unpatched, _ = _trained_losses(tmp_path, bert, causal=False)
    callback = ActQCallback(bits=3)
    patched, trainer = _trained_losses(tmp_path, bert, causal=False, callback=callback)
    assert callback.handle is not None and callback.handle.patched  # patched at init
    assert "hf_actq=" in repr(trainer.model)
    _assert_tracks(patched, unpatched)


def test_trainer_tiny_llama_with_gradient_checkpointing_and_accumulation(tmp_path):
    extra = dict(activation_checkpointing=True, gradient_accumulation_steps=2)
    unpatched, _ = _trained_losses(tmp_path, _llama, causal=True, **extra)
    callback = ActQCallback(bits=4)
    patched, _ = _trained_losses(tmp_path, _llama, causal=True, callback=callback, **extra)
    assert any(d.startswith("gated_mlp") for d in callback.handle.patched.values())
    _assert_tracks(patched, unpatched)


def test_callback_added_after_init_patches_at_train_begin(tmp_path):
    trainer = Trainer(model=_bert(), args=_args(tmp_path), train_dataset=Toy(False))
    callback = ActQCallback(bits=4)
    trainer.add_callback(callback)
    assert callback.handle is None
    trainer.train()
    assert callback.handle is not None and callback.handle.patched


def test_callback_logs_activation_memory_that_matches_a_direct_count(tmp_path):
    callback = ActQCallback(bits=3)
    trainer = Trainer(
        model=_bert(), args=_args(tmp_path), train_dataset=Toy(False), callbacks=[callback]
    )
    trainer.train()
    logged = [e["actq_activation_mib"] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 4 and len(callback.memory_history) == 4
    # Saved sizes depend on shapes only, so any 4 x 16 batch gives the same count.
    model = trainer.model
    model.train()
    batch = {key: value.clone() for key, value in Toy(False)[:4].items()}  # own storage
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        model(**batch)
    assert callback.memory_history[0]["activation_bytes"] == meter.nbytes
    assert logged[0] == round(meter.nbytes / 2**20, 3)


def test_callback_memory_logging_with_accumulation_and_checkpointing(tmp_path):
    figures = {}
    for checkpointing in (False, True):
        callback = ActQCallback(bits=4)
        args = _args(
            tmp_path, activation_checkpointing=checkpointing, gradient_accumulation_steps=2
        )
        Trainer(model=_llama(), args=args, train_dataset=Toy(True), callbacks=[callback]).train()
        history = callback.memory_history
        assert [r["step"] for r in history] == [1, 2, 3, 4]
        figures[checkpointing] = history[0]["activation_bytes"]
    assert 0 < figures[True] < figures[False]


def test_memory_logging_can_be_turned_off(tmp_path):
    callback = ActQCallback(bits=3, log_memory=False)
    trainer = Trainer(
        model=_bert(), args=_args(tmp_path), train_dataset=Toy(False), callbacks=[callback]
    )
    trainer.train()
    assert not callback.memory_history
    assert not any("actq_activation_mib" in e for e in trainer.state.log_history)


def test_memory_is_metered_on_the_first_and_on_logging_steps(tmp_path):
    callback = ActQCallback(bits=3)
    args = _args(tmp_path)
    args.logging_steps = 2
    trainer = Trainer(model=_bert(), args=args, train_dataset=Toy(False), callbacks=[callback])
    trainer.train()
    assert [r["step"] for r in callback.memory_history] == [1, 2, 4]
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4]
    assert all(e["actq_activation_mib"] > 0 for e in logged)


def test_adaptive_callback_plans_before_training_and_again_after_a_fraction(tmp_path, caplog):
    from hf_actq import ActQConfig
    from hf_actq.adaptive import BitPlan

    config = ActQConfig.from_recipe("alam", bits=1, calibration_examples=2, recalibrate_at=0.25)
    callback = ActQCallback(config)
    trainer = Trainer(
        model=_llama(), args=_args(tmp_path), train_dataset=Toy(True), callbacks=[callback]
    )
    with caplog.at_level(logging.INFO, logger="hf_actq"):
        trainer.train()
    assert callback.calibrated_at == [0, 1]  # before step 1, and after a quarter of 4 steps
    assert "plan for 1 bits on average before step 0" in caplog.text
    saved = BitPlan.load(tmp_path / "actq_plan.json")
    assert saved == callback.handle.plan
    saved.check_slots(callback.handle.slots)
    assert saved.info["bytes"] <= saved.info["budget_bytes"]
    assert all(torch.isfinite(torch.tensor(_losses(trainer))))


def _sft_losses(tmp_path, callbacks, peft_config=None, steps=12, learning_rate=1e-2):
    """TRL's SFTTrainer on the tiny LLaMA (pre-tokenized rows, a word-level tokenizer of the
    model's 100 ids), with ``callbacks``."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"t{i}": i for i in range(100)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="t3")),
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
    )
    rows = datasets.Dataset.from_dict({"input_ids": Toy(causal=True, n=8).ids.tolist()})
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=learning_rate, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=_llama(), args=args, train_dataset=rows, processing_class=tokenizer,
        callbacks=callbacks, peft_config=peft_config,
    )  # fmt: skip
    trainer.train()
    return _losses(trainer), trainer


@pytest.mark.parametrize("peft", [False, True])
def test_trl_sft_trainer_with_the_callback_tracks_the_unpatched_loss(tmp_path, peft):
    """TRL's SFTTrainer reads the logits in training (TRL 0.x and 1.0: its entropy and token
    accuracy) or computes the loss with a fused LM head of its own around the model's forward
    (later versions): the callback turns hf_actq's fused loss off for it and patches the rest."""
    settings = {}
    if peft:  # adapters on a random model learn slowly: more steps, a larger rate
        lora = pytest.importorskip("peft").LoraConfig(r=8, target_modules="all-linear")
        settings = dict(peft_config=lora, steps=60, learning_rate=5e-2)
    unpatched, _ = _sft_losses(tmp_path / "unpatched", [], **settings)
    callback = ActQCallback(bits=4)
    patched, trainer = _sft_losses(tmp_path / "patched", [callback], **settings)
    assert callback.config.fused_loss is False and "" not in callback.handle.patched
    assert any("self_attn" in path for path in callback.handle.patched)
    assert any("actq_activation_mib" in entry for entry in trainer.state.log_history)
    if not peft:
        _assert_tracks(patched, unpatched)
        return
    # Adapters on random weights at this rate follow a chaotic path (a near-exact few-bit run
    # ends 0.12 away from the unpatched one): the forward is exact and the loss falls.
    assert patched[0] == pytest.approx(unpatched[0], rel=1e-6, abs=0)
    assert patched[0] - min(patched[-6:]) > 0.5 * (unpatched[0] - min(unpatched[-6:])) > 0.05
