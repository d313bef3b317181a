import logging
import math
import re

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_utils import SaveStrategy

from hf_actq import ActQCallback, SavedTensorMeter
from hf_actq.testing import checkpointing_argument
from hf_actq.testing import tiny_llama as _llama


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
    extra = {checkpointing_argument(): True, "gradient_accumulation_steps": 2}
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
            tmp_path, **{checkpointing_argument(): checkpointing}, gradient_accumulation_steps=2
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

    config = ActQConfig.from_recipe(
        "alam", bits=1, calibration_examples=2, recalibrate_at=0.5, calibration_step=0
    )
    callback = ActQCallback(config)
    trainer = Trainer(
        model=_llama(), args=_args(tmp_path), train_dataset=Toy(True), callbacks=[callback]
    )
    with caplog.at_level(logging.INFO, logger="hf_actq"):
        trainer.train()
    assert callback.calibrated_at == [0, 2]  # before step 1, and after half of 4 steps
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


# With PEFT: 13 s, and tests/integrations/test_peft.py trains a PEFT model with the callback.
@pytest.mark.parametrize("peft", [False, pytest.param(True, marks=pytest.mark.slow)])
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


def _alam_trainer(tmp_path, dataset, **extra):
    from hf_actq import ActQConfig

    config = ActQConfig.from_recipe(
        "alam", bits=1, calibration_examples=2, recalibrate_at=0.25, calibration_step=0
    )
    callback = ActQCallback(config)
    args = _args(tmp_path)
    for name, value in extra.items():
        setattr(args, name, value)
    trainer = Trainer(model=_llama(), args=args, train_dataset=dataset, callbacks=[callback])
    return trainer, callback


def _measured(plan) -> dict:
    """A plan's settings and what it measured, without how long that took."""
    return {**plan.to_dict(), "info": {**plan.info, "seconds": None}}


# Restoring the callback's own state from the checkpoint: 8 s more, with -m slow.
@pytest.mark.parametrize("restore_states", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_resuming_from_a_checkpoint_keeps_the_plan_and_the_losses(tmp_path, restore_states):
    # restore_callback_states_from_checkpoint=True: Trainer builds a new callback from the
    # checkpoint's state() and drops the given one.
    from hf_actq.adaptive import BitPlan

    extra = dict(max_steps=8, save_strategy=SaveStrategy.STEPS, save_steps=2)
    extra["restore_callback_states_from_checkpoint"] = restore_states
    whole, callback = _alam_trainer(tmp_path / "whole", Toy(True), **extra)
    whole.train()
    assert callback.calibrated_at == [0, 2]
    # Before and after the re-plan at a quarter of the steps.
    for step in (4,) if restore_states else (2, 4):
        checkpoint = tmp_path / "whole" / f"checkpoint-{step}"
        in_force = callback.plans[0 if step == 2 else 1]
        assert BitPlan.load(checkpoint / "actq_plan.json") == in_force
        out = tmp_path / f"resumed-{step}"
        resumed, resumed_callback = _alam_trainer(out, Toy(True), **extra)
        resumed.train(resume_from_checkpoint=str(checkpoint))
        if restore_states:
            (resumed_callback,) = [
                c for c in resumed.callback_handler.callbacks if isinstance(c, ActQCallback)
            ]
        assert _measured(resumed_callback.handle.plan) == _measured(callback.handle.plan)
        assert resumed_callback.calibrated_at == [0, 2]
        assert _losses(resumed) == _losses(whole)  # the history up to the checkpoint, then on
        # Only the re-plan that was still to come was made (and written) again.
        assert (out / "actq_plan.json").exists() == (step == 2)


def test_calibration_moves_on_from_a_batch_it_cannot_measure(tmp_path, caplog):
    dataset = Toy(True)
    dataset.labels = dataset.labels.clone()
    dataset.labels[:2] = -100  # the first calibration block: no supervised token
    trainer, callback = _alam_trainer(tmp_path, dataset)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        trainer.train()
    assert "calibration batch 1 of 8 could not be measured (calibration: the loss" in caplog.text
    assert callback.calibrated_at == [0, 1] and len(callback.plans) == 2
    assert all(torch.isfinite(torch.tensor(_losses(trainer))))


def test_batches_with_no_supervised_token_train_as_without_hf_actq(tmp_path):
    # Batch 1, every other example's labels all ignored (a prompt longer than the sequence):
    # with the fused loss those steps once gave NaN gradients, and the weights went NaN after
    # one AdamW step while the log showed loss 0.
    dataset = Toy(True, n=8)
    dataset.labels = dataset.labels.clone()
    dataset.labels[::2] = -100
    runs = {}
    for name, callbacks in (("stock", []), ("patched", [ActQCallback(bits=4)])):
        args = _args(tmp_path / name)
        args.max_steps, args.per_device_train_batch_size = 6, 1
        trainer = Trainer(model=_llama(), args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
        logged = [e for e in trainer.state.log_history if "loss" in e]
        runs[name] = [(e["loss"], e["grad_norm"]) for e in logged]
        assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    stock, patched = runs["stock"], runs["patched"]
    assert [math.isfinite(g) for _, g in patched] == [math.isfinite(g) for _, g in stock]
    assert all(math.isfinite(g) for _, g in stock)
    for (loss, _), (stock_loss, _) in zip(patched, stock):
        assert loss == pytest.approx(stock_loss, rel=0.02, abs=1e-6)


def test_a_callback_on_a_model_patched_with_another_config_says_so(tmp_path):
    # It used to keep the model's patch and record its own config, silently.
    import hf_actq

    model = _llama()
    hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform"))
    callback = ActQCallback(recipe="alam")
    with pytest.raises(ValueError, match="already patched with another config \\(recipe: 'alam'"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=Toy(True), callbacks=[callback])
    # The model's own config: the callback takes the model's patch.
    callback = ActQCallback(recipe="uniform")
    Trainer(model=model, args=_args(tmp_path), train_dataset=Toy(True), callbacks=[callback])
    assert callback.handle is hf_actq.integrations.transformers.unwrap(model)._hf_actq_handle


def test_resuming_with_other_bits_calibrates_for_them_and_says_so(tmp_path, caplog):
    # It used to install the checkpoint's plan (for the old bits) without a word.
    from hf_actq import ActQConfig

    extra = dict(max_steps=4, save_strategy=SaveStrategy.STEPS, save_steps=2)
    whole, _ = _alam_trainer(tmp_path / "whole", Toy(True), **extra)
    whole.train()
    config = ActQConfig.from_recipe(
        "alam", bits=2, calibration_examples=2, recalibrate_at=0.25, calibration_step=0
    )
    callback = ActQCallback(config)
    args = _args(tmp_path / "resumed")
    for name, value in extra.items():
        setattr(args, name, value)
    resumed = Trainer(model=_llama(), args=args, train_dataset=Toy(True), callbacks=[callback])
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert (
        "the checkpoint's plan is for bits=1 and this run's config asks for bits=2" in caplog.text
    )
    assert callback.handle.plan.target_bits == 2


def test_alam_calibrates_after_the_first_step_as_its_code_does(tmp_path, caplog):
    # ALAM's run_glue calls its controller after each optimizer step, and the first plan is
    # made there: step 1 trains at the even spread.
    from hf_actq import ActQConfig

    config = ActQConfig.from_recipe("alam", bits=1, calibration_examples=2, recalibrate_at=0.5)
    assert config.calibration_step == 1
    callback = ActQCallback(config)
    trainer = Trainer(
        model=_llama(), args=_args(tmp_path), train_dataset=Toy(True), callbacks=[callback]
    )
    with caplog.at_level(logging.INFO, logger="hf_actq"):
        trainer.train()
    assert callback.calibrated_at == [1, 2]
    assert "plan for 1 bits on average before step 1" in caplog.text


def test_the_callback_says_in_one_line_what_it_patched_and_left_stock(tmp_path, caplog):
    """The start-of-training line: the recipe and what it keeps, the modules patched by kind,
    the ones left stock with why, then what the first step kept."""
    with caplog.at_level(logging.INFO, logger="hf_actq"):
        trainer = Trainer(
            model=_bert(),
            args=_args(tmp_path),
            train_dataset=Toy(causal=False),
            callbacks=[ActQCallback(recipe="uniform", skip_modules=["classifier"])],
        )
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_actq: ")]
    assert lines[0] == (
        'hf_actq: "uniform" (4-bit stochastic rounding; 4-bit activation derivatives): patched '
        "2 activation, 2 attention, 8 dropout, 13 linear, 5 norm; left stock: 1 tanh keeps its "
        "output, which the next op keeps exactly too (a few-bit copy would add bytes) "
        "(bert.pooler.activation); 1 skip_modules (classifier)"
    )
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ActQCallback))
    kept = callback.memory_history[0]["activation_bytes"]
    first = [line for line in lines if "the first step kept" in line]
    assert len(first) == 1 and re.fullmatch(
        rf"hf_actq: the first step kept {kept / 1024:.1f} KiB of activations for backward; "
        r"with the tensors it compressed at full size, [0-9.]+ KiB "
        r"\([0-9.]+x; `hf-actq memory` measures the unpatched model\)",
        first[0],
    ), first


@pytest.mark.parametrize("log_level", ["info", "passive"])
def test_the_callbacks_lines_show_when_the_trainer_is_asked_for_info(tmp_path, capsys, log_level):
    """With ``log_level="info"`` (the Trainer's own start lines shown) and no logging set up,
    the callback's lines reach stderr; by default only warnings would."""
    from transformers.utils import logging as hf_logging

    hf_logger = logging.getLogger("hf_actq")
    root = logging.getLogger()
    saved = root.handlers[:], hf_logger.handlers[:], hf_logger.level
    # "passive" keeps transformers' verbosity, which a Trainer asked for "info" set globally.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    root.handlers.clear()  # as in a plain script (pytest's capture handlers aside)
    try:
        trainer = Trainer(
            model=_bert(),
            args=_args(tmp_path, log_level=log_level, disable_tqdm=True),
            train_dataset=Toy(causal=False),
            callbacks=[ActQCallback()],
        )
        trainer.train()
    finally:
        for handler in hf_logger.handlers[:]:
            if handler not in saved[1]:
                hf_logger.removeHandler(handler)
        root.handlers[:] = saved[0]
        hf_logger.setLevel(saved[2])
        hf_logging.set_verbosity(verbosity)
    err = capsys.readouterr().err
    shown = "hf_actq: 4-bit stochastic rounding" in err and "the first step kept" in err
    assert shown == (log_level == "info"), err[-2000:]
