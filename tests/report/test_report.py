"""measure_model: side-by-side recipes, layer extrapolation, PEFT, outputs."""

import json

import pytest
import torch

from hf_actq.adaptive.plan import BitPlan
from hf_actq.report import measure_model, parse_recipe
from hf_actq.report.presets import PRESETS, preset_config


def _four_layer_llama():
    config = preset_config("tiny-llama")
    config.num_hidden_layers = 4
    return config


def test_recipes_are_measured_side_by_side_and_the_counts_agree():
    report = measure_model(
        preset_config("tiny-llama"), ["fewbit", "uniform:bits=4"], batch_size=2, seq_len=32
    )
    rows = report.rows()
    assert [row["recipe"] for row in rows] == ["baseline", "fewbit", "uniform:bits=4"]
    for row in rows:
        assert row["activation_bytes"] == row["independent_count_bytes"]
        assert sum(row["by_kind"].values()) == row["activation_bytes"]
    base, fewbit, uniform = (r.measurement for r in report.results)
    assert base.activation_bytes > fewbit.activation_bytes > uniform.activation_bytes
    # Recipes change what is saved, never the model state.
    assert base.model_state_bytes == fewbit.model_state_bytes == uniform.model_state_bytes
    assert base.grad_bytes == base.param_bytes - _buffer_bytes() and base.optimizer_bytes > 0
    assert base.peak_bytes >= base.param_bytes + base.optimizer_bytes + base.activation_bytes
    assert rows[2]["compression"] == pytest.approx(base.activation_bytes / uniform.activation_bytes)
    assert report.results[1].config["recipe"] == "fewbit" and report.results[1].patched_modules > 0


def _buffer_bytes():
    from hf_actq.report import build_model

    model = build_model(preset_config("tiny-llama"), 2, torch.float32, "none", "causal-lm", "cpu")
    return sum(b.untyped_storage().nbytes() for b in model.buffers())


def test_layer_extrapolation_matches_the_whole_model():
    config = _four_layer_llama()
    kwargs = dict(batch_size=2, seq_len=16)
    whole = measure_model(config, ["uniform"], layers="all", **kwargs)
    scaled = measure_model(config, ["uniform"], layers="scaled", **kwargs)
    assert whole.measured_layers == [4] and scaled.measured_layers == [1, 2] and scaled.scaled
    for a, b in zip(whole.results, scaled.results):
        for name in ("activation_bytes", "graph_bytes", "param_bytes", "optimizer_bytes"):
            assert getattr(a.measurement, name) == getattr(b.measurement, name), name
        assert a.measurement.by_kind == {k: v for k, v in b.measurement.by_kind.items() if v}
    assert "extrapolated linearly to 4" in scaled.to_markdown()


def test_a_hybrid_decoder_is_extrapolated_by_whole_runs_of_its_layer_kinds():
    """Qwen3.5 repeats a linear-attention and an attention layer (here; three and one as
    released): the scaled report measures one run and two, and matches the whole model; a
    sliding/full mix of attention layers scales by single layers."""
    from transformers import AutoConfig

    from hf_actq.report.measure import layer_period
    from hf_actq.testing import TINY_SIZES

    sizes = dict(TINY_SIZES["qwen3_5_text"], num_hidden_layers=6, vocab_size=100)
    sizes["layer_types"] = ["linear_attention", "full_attention"] * 3
    config = AutoConfig.for_model("qwen3_5_text", **sizes)
    assert layer_period(config) == 2
    assert layer_period(AutoConfig.for_model("gemma3_text")) == 1
    assert layer_period(AutoConfig.for_model("gemma4_text")) == 6  # full layers' wider heads
    kwargs = dict(batch_size=1, seq_len=8)
    whole = measure_model(config, ["uniform"], layers="all", **kwargs)
    scaled = measure_model(config, ["uniform"], layers="scaled", **kwargs)
    assert whole.measured_layers == [6] and scaled.measured_layers == [2, 4]
    for a, b in zip(whole.results, scaled.results):
        for name in ("activation_bytes", "param_bytes", "optimizer_bytes"):
            assert getattr(a.measurement, name) == getattr(b.measurement, name), name


@pytest.mark.slow  # 24 s: a 32000-token vocabulary at 1 to 24 layers
def test_the_peak_is_extrapolated_per_phase_when_its_phase_changes_with_depth():
    """Stock logits of a large vocabulary hold the peak at the head's backward in 1 and 2
    layers; 4-bit activations grow by less per layer than the gradients the optimizer step
    holds, so at 24 layers the peak is the optimizer step's. Extrapolating the step's peak
    follows the head's slope (9% low here); each phase extrapolated on its own does not."""
    config = preset_config("tiny-llama")
    config.hidden_size, config.head_dim, config.intermediate_size = 64, 16, 4096
    config.vocab_size, config.tie_word_embeddings = 32000, True
    recipe = "uniform:bits=4,fused_loss=false"
    kwargs = dict(batch_size=1, seq_len=128)

    def measured(depth):
        config.num_hidden_layers = depth
        return measure_model(config, [recipe], layers="all", **kwargs).results[1].measurement

    one, two, whole = measured(1), measured(2), measured(24)
    assert one.peak_phase == two.peak_phase == "head backward"
    assert whole.peak_phase == "optimizer step"
    step_peak_extrapolated = one.peak_bytes + 23 * (two.peak_bytes - one.peak_bytes)
    assert step_peak_extrapolated < 0.95 * whole.peak_bytes  # the estimate this replaces
    scaled = measure_model(config, [recipe], layers="scaled", **kwargs)
    estimate = scaled.results[1].measurement
    assert scaled.measured_layers == [1, 2] and estimate.peak_phase == "optimizer step"
    assert estimate.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.01)
    assert set(estimate.peak_by_phase) == {
        "forward", "head backward", "layer backward", "embedding backward", "optimizer step"
    }  # fmt: skip
    assert "(optimizer step)" in scaled.to_markdown()


@pytest.mark.slow  # 10 s
def test_a_vision_language_model_is_measured_on_its_text_tower():
    # Its depth, vocabulary and positions are in text_config; LLaVA has no causal-LM auto class.
    from transformers import AutoConfig

    tower = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    config = AutoConfig.for_model(
        "llava",
        text_config=dict(tower, model_type="llama", num_hidden_layers=4, vocab_size=128),
        vision_config=dict(tower, model_type="clip_vision_model", image_size=32, patch_size=8),
        image_token_id=120,
    )
    kwargs = dict(batch_size=2, seq_len=16)
    whole = measure_model(config, ["uniform:bits=4"], layers="all", **kwargs)
    scaled = measure_model(config, ["uniform:bits=4"], layers="scaled", **kwargs)
    assert whole.num_layers == 4 and scaled.measured_layers == [1, 2]
    for a, b in zip(whole.results, scaled.results):
        assert a.measurement.activation_bytes == b.measurement.activation_bytes > 0
        assert a.measurement.param_bytes == b.measurement.param_bytes
    # The fused loss is bound to its head: no [tokens, vocab] log-probabilities kept.
    base, uniform = (r.measurement.by_kind["lm_loss"] for r in whole.results)
    assert base >= 2 * 16 * 128 * 4 > uniform
    assert "measured on text alone" in whole.to_markdown()
    # The phases are marked on the language model's layers, not the vision tower's.
    assert "embedding backward" in whole.results[0].measurement.peak_by_phase


@pytest.mark.slow  # 14 s; test_adaptive_recipes_show_and_write_their_plan plans in the default run
def test_scaled_adaptive_recipes_extrapolate_one_plan(tmp_path):
    """The 1-layer model takes the 2-layer model's plan, so the extrapolation is the bytes of
    the full model under that plan with every later layer set like layer 1."""
    config = _four_layer_llama()
    kwargs = dict(batch_size=2, seq_len=16)
    # At 2 bits the 1- and 2-layer models' own plans differ here (the extrapolation was 21% high).
    scaled = measure_model(config, ["alam:bits=2"], layers="scaled", **kwargs)
    plan = scaled.results[1].plan
    assert plan is not None and any(".layers.1." in slot for slot in plan["slots"])
    four = {}
    for slot, setting in plan["slots"].items():
        for layer in (1, 2, 3) if ".layers.1." in slot else (None,):
            four[slot.replace(".layers.1.", f".layers.{layer}.") if layer else slot] = setting
    BitPlan(four, 2).save(tmp_path / "plan.json")
    whole = measure_model(config, [f"alam:bits=2,plan={tmp_path / 'plan.json'}"], **kwargs)
    assert whole.measured_layers == [4]
    expected, got = whole.results[1].measurement, scaled.results[1].measurement
    assert got.activation_bytes == expected.activation_bytes
    assert got.by_kind == {k: v for k, v in expected.by_kind.items() if v}


def test_max_batch_follows_the_papers_appendix_b():
    report = measure_model(
        preset_config("tiny-bert"), ["fewbit"], batch_size=4, seq_len=32, gpu_memory_bytes=2**30
    )
    for row, result in zip(report.rows(), report.results):
        per_sample = result.measurement.activation_bytes / 4
        expected = int((2**30 - result.measurement.model_state_bytes) // per_sample)
        assert row["max_batch_size"] == expected
    assert report.rows()[1]["max_batch_size"] > report.rows()[0]["max_batch_size"]


def test_checkpoint_recipe_keeps_layer_inputs_only_and_its_max_batch_counts_one_recompute():
    report = measure_model(
        _four_layer_llama(), ["checkpoint"], batch_size=2, seq_len=32, gpu_memory_bytes=2**30
    )
    base, packed = (result.measurement for result in report.results)
    assert packed.activation_bytes < base.activation_bytes / 8
    assert packed.activation_bytes == packed.graph_bytes
    # One stock layer's activations per example on top, while it is recomputed.
    per_sample = (packed.activation_bytes + base.activation_bytes / 4) / 2
    expected = int((2**30 - packed.model_state_bytes) // per_sample)
    assert report.rows()[1]["max_batch_size"] == expected


def test_a_checkpointing_recipe_prints_no_use_cache_warning(monkeypatch):
    """transformers warns (once a process) when a checkpointed layer sees use_cache=True; the
    report turns the cache off first, as that warning would, so its output stays clean."""
    from transformers.utils import generic

    warned = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a: warned.append(message))
    config = preset_config("tiny-llama")
    assert config.use_cache
    report = measure_model(config, ["checkpoint", "stock-checkpointing"], batch_size=2, seq_len=16)
    assert [row["keeps"] for row in report.rows()] == [
        "the unpatched model",
        "layers recomputed from 4-bit rotated inputs; the rest 8-bit",
        "unpatched; layers recomputed (gradient_checkpointing=True)",
    ]
    assert not [message for message in warned if "use_cache" in message]


def test_stock_checkpointing_is_measured_with_the_layer_inputs_it_keeps():
    """The unpatched model under transformers' own checkpointing: what it keeps outside the
    layers, plus each layer's inputs (held by the checkpoint, which saved-tensor hooks never
    see): 4 layers x a [2, 32, 32] fp32 input, the layers' shared rotary tables and mask once.
    Its peak and max batch carry a recomputed layer, as "checkpoint"'s do."""
    report = measure_model(
        _four_layer_llama(),
        ["stock-checkpointing", "checkpoint"],
        batch_size=2,
        seq_len=32,
        gpu_memory_bytes=2**30,
    )
    base, stock, packed = (result.measurement for result in report.results)
    assert [result.label for result in report.results][1] == "stock-checkpointing"
    assert report.results[1].config is None and report.results[1].patched_modules == 0
    layer_inputs = 4 * 2 * 32 * 32 * 4
    assert stock.by_kind["other"] >= layer_inputs  # the decoder layers' own kind
    assert packed.activation_bytes < stock.activation_bytes < base.activation_bytes / 2
    assert stock.peak_bytes <= base.peak_bytes  # here the optimizer step holds both peaks
    per_sample = (stock.activation_bytes + base.activation_bytes / 4) / 2
    expected = int((2**30 - stock.model_state_bytes) // per_sample)
    assert report.rows()[1]["max_batch_size"] == expected
    with pytest.raises(ValueError, match="takes no overrides"):
        parse_recipe("stock-checkpointing:bits=4")


def test_lora_keeps_frozen_weights_out_of_gradients_and_optimizer():
    pytest.importorskip("peft")
    full = measure_model(preset_config("tiny-llama"), [], batch_size=2, seq_len=16)
    lora = measure_model(
        preset_config("tiny-llama"), ["alam"], batch_size=2, seq_len=16, peft="lora"
    )
    base = lora.results[0].measurement
    assert base.grad_bytes < full.results[0].measurement.grad_bytes / 4
    assert lora.results[1].measurement.activation_bytes < base.activation_bytes
    # LoRA's `* scaling` keeps the Python float as an 8-byte wrapped-number tensor that autograd
    # stores without calling saved-tensor hooks: the graph walk sees 8 bytes per adapter more.
    for row in lora.rows():
        assert row["activation_bytes"] == pytest.approx(row["independent_count_bytes"], rel=1e-3)


def test_lora_on_a_mixture_of_experts_trains_its_experts_parameters():
    """PEFT turns "all-linear" on Qwen3-MoE's experts (linear layers in transformers 4) into LoRA
    on their fused parameters, which refuses dropout ("lora.ParamWrapper does not work with
    lora_dropout != 0"): the report's LoRA takes none there, and measures."""
    pytest.importorskip("peft")
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    report = measure_model(config, ["uniform"], batch_size=2, seq_len=16, peft="lora")
    base, uniform = (result.measurement for result in report.results)
    assert uniform.activation_bytes < base.activation_bytes
    # The graph walk sees up to 8 bytes per adapter that saved-tensor hooks do not (see
    # test_lora_keeps_frozen_weights_out_of_gradients_and_optimizer).
    from hf_actq.report import build_model

    model = build_model(config, 2, torch.float32, "lora", "causal-lm", "cpu")
    adapters = sum(hasattr(module, "lora_A") for module in model.modules())
    for row in report.rows():
        assert row["activation_bytes"] == pytest.approx(
            row["independent_count_bytes"], rel=1e-3, abs=8 * adapters
        )


def test_qlora_params_are_four_bit():
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    lora = measure_model(preset_config("tiny-llama"), [], batch_size=1, seq_len=8, peft="lora")
    qlora = measure_model(
        preset_config("tiny-llama"), ["fewbit"], batch_size=1, seq_len=8, peft="qlora"
    )
    assert qlora.results[0].measurement.param_bytes < lora.results[0].measurement.param_bytes
    for row in qlora.rows():
        assert row["activation_bytes"] == pytest.approx(row["independent_count_bytes"], rel=1e-3)


def test_reports_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    report = measure_model(preset_config("tiny-bert"), ["fewbit"], batch_size=2, seq_len=16)
    paths = report.write(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == ["memory.json", "memory.md", "memory.png"]
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["rows"][1]["recipe"] == "fewbit" and data["scaled"] is False
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert "| fewbit |" in (tmp_path / "memory.md").read_text()


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="unknown recipe 'fast'"):
        parse_recipe("fast")
    with pytest.raises(ValueError, match="key=value"):
        parse_recipe("uniform:4")
    with pytest.raises(ValueError, match="bits must be"):
        parse_recipe("uniform:bits=9")
    with pytest.raises(ValueError, match="peft must be one of"):
        measure_model(preset_config("tiny-bert"), [], peft="dora")
    assert parse_recipe("alam:bits=0.5,dropout_mode=mask")[1].bits == 0.5


@pytest.mark.slow
# bf16 presets run torch's reference GEMMs on a CPU without bf16 instructions: Gemma 3 4B took
# over the suite's 15-minute limit (pytest-timeout) on 2 cores.
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("preset", [p for p in PRESETS if not p.startswith("tiny")])
def test_every_preset_measures_offline(preset):
    report = measure_model(
        preset_config(preset),
        ["fewbit"],
        name=preset,
        batch_size=1,
        seq_len=32,
        layers="scaled",
        dtype=PRESETS[preset].dtype,
        task=PRESETS[preset].task,
        # Two Mixtral layers fully trained (weights, gradients, Adam) would take 22 GB of RAM,
        # Gemma 3 4B's vocabulary and vision tower 10 GB, two gpt-oss-20b layers 13 GB, two
        # Qwen3-30B-A3B layers 12 GB.
        peft="lora"
        if preset.startswith(("mixtral", "gemma3-4b", "gpt-oss", "qwen3-30b"))
        else "none",
    )
    for row in report.rows():
        assert (
            abs(row["activation_bytes"] - row["independent_count_bytes"])
            <= 0.02 * row["activation_bytes"]
        )
    assert report.rows()[1]["activation_bytes"] < report.rows()[0]["activation_bytes"]


def test_sequence_longer_than_the_positions_is_rejected():
    with pytest.raises(ValueError, match="seq_len 513 exceeds the 512 positions roberta supports"):
        measure_model(preset_config("roberta-base"), [], seq_len=513)


def test_adaptive_recipes_show_and_write_their_plan(tmp_path):
    report = measure_model(
        preset_config("tiny-llama"),
        [
            "alam:bits=1",
            "alam:bits=1,calibration_examples=8,calibration_slots=2",
            "alam:bits=1,adaptive=False",
        ],
        batch_size=2,
        seq_len=16,
    )
    official, more_examples, even = report.results[1:]
    assert even.plan is None and official.plan is not None and more_examples.plan is not None
    info = official.plan["info"]
    # ALAM's accounting: code bits only, so its 1 bit keeps more than 1 bit once counted.
    assert info["bytes"] <= info["budget_bytes"] and info["alam_bits"] <= 1
    assert info["counted_bytes"] > info["bytes"]
    assert info["examples"] == 1  # the report's 2, capped by ALAM's one example
    # A recipe asking for more examples gets the report's 2 (the batch); slots are capped by
    # the report's 4, or by the recipe's own count when it is lower.
    assert more_examples.plan["info"]["examples"] == 2
    assert info["measured"] == 4 and more_examples.plan["info"]["measured"] == 2
    assert info["estimated"] == more_examples.plan["info"]["estimated"] - 2 > 0
    text = report.to_markdown()
    assert "Bit plan of alam:bits=1, 1 bit on average: by ALAM's accounting" in text
    assert "Bit plan of alam:bits=1,calibration_examples=8,calibration_slots=2, 1 bit" in text
    assert "| attention |" in text
    # The settings' notation is explained under the plan, and the rows say what they keep.
    assert "`aq B/G` is ALAM's average quantization" in text
    assert (
        "| alam:bits=1,adaptive=False | 1-bit average quantization (ALAM); 1-bit activation" in text
    )
    assert "| alam:bits=1 | average quantization (ALAM), 1 bit on average, planned" in text
    paths = report.write(str(tmp_path))
    assert str(tmp_path / "plan_alam_bits1.json") in paths
    assert str(tmp_path / "bits_alam_bits1.png") in paths


def test_a_recipe_whose_peak_exceeds_the_baseline_is_flagged():
    # The first few-bit step of a process loads the derivative tables (16 KiB here, 0.2% of
    # this tiny model's peak; they stay for the process): measured once before, they are not in
    # the step's peak, which is then the baseline's within a few hundred bytes: not flagged.
    measure_model(preset_config("tiny-llama"), ["fewbit"], batch_size=2, seq_len=16)
    report = measure_model(preset_config("tiny-llama"), ["fewbit"], batch_size=2, seq_len=16)
    base, fewbit = (r.measurement for r in report.results)
    assert "above baseline" not in report.to_markdown()
    assert fewbit.peak_bytes < base.peak_bytes * 1.001
    fewbit.peak_bytes = int(base.peak_bytes * 1.01)  # as if the recipe had raised the peak
    text = report.to_markdown()
    assert "**above baseline**" in text and "Warning: the step peak of fewbit is above" in text


def test_an_encoder_decoder_is_measured_as_seq2seq_and_scales_both_stacks():
    # T5: the task follows the config, both stacks get the measured depth, and the 1- and
    # 2-layer extrapolation equals the whole 4-layer model.
    config = preset_config("tiny-t5")
    config.num_layers = config.num_decoder_layers = 4
    kwargs = dict(batch_size=2, seq_len=16)
    whole = measure_model(config, ["uniform:bits=4"], layers="all", **kwargs)
    scaled = measure_model(config, ["uniform:bits=4"], layers="scaled", **kwargs)
    assert whole.task == "seq2seq-lm" and scaled.measured_layers == [1, 2]
    for row in whole.rows():
        # The graph walk finds 192 bytes more than the hooks in stock T5 (of 2.5 MB; measured).
        assert row["activation_bytes"] == pytest.approx(row["independent_count_bytes"], rel=1e-3)
    base, uniform = (r.measurement for r in whole.results)
    assert uniform.activation_bytes < base.activation_bytes / 4
    assert uniform.by_kind["attention"] < base.by_kind["attention"]
    for a, b in zip(whole.results, scaled.results):
        for name in ("activation_bytes", "param_bytes", "optimizer_bytes"):
            assert getattr(a.measurement, name) == getattr(b.measurement, name), name


def test_a_mixture_of_experts_decoder_counts_its_experts_as_mlp():
    report = measure_model(
        preset_config("tiny-mixtral"), ["uniform:bits=4"], batch_size=2, seq_len=32
    )
    for row in report.rows():
        assert row["activation_bytes"] == row["independent_count_bytes"]
    base, uniform = (r.measurement for r in report.results)
    # The experts (and the exact router) save under "mlp", not "other".
    assert base.by_kind["mlp"] > 0.3 * base.activation_bytes and not base.by_kind.get("other")
    assert uniform.by_kind["mlp"] < base.by_kind["mlp"] / 4
