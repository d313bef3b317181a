"""recipes/llama_lora: the Alpaca formatting and label masking, packing, and run.py end to end
on a tiny LLaMA with a word-level tokenizer and a tiny Alpaca file written here (LoRA patched and
unpatched, full fine-tuning); QLoRA on CPU is the slow test."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("peft")

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes" / "llama_lora"

spec = importlib.util.spec_from_file_location("llama_lora_run", RECIPE_DIR / "run.py")
run = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = run  # dataclasses look their module up there
spec.loader.exec_module(run)

WORDS = "add two numbers name a colour red blue green sum of and is the answer what say hello"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer LLaMA with random weights and a word-level tokenizer, saved as a model dir."""
    return _save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def _save_tiny_model(root, **overrides):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_actq.testing import tiny_llama

    prompt_words = (run.PROMPT_WITH_INPUT + run.PROMPT_WITHOUT_INPUT).split()
    words = dict.fromkeys(["<unk>", "<s>", "</s>", "<pad>", *WORDS.split(), *prompt_words, "#"])
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tiny_llama(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    ).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def alpaca_file(tmp_path_factory):
    records = []
    for i in range(40):
        if i % 2:
            records.append(
                {
                    "instruction": "add two numbers",
                    "input": "two and two",
                    "output": "the sum is red",
                }
            )
        else:
            records.append(
                {"instruction": "name a colour", "input": "", "output": "blue green red"}
            )
    path = tmp_path_factory.mktemp("data") / "alpaca.json"
    path.write_text(json.dumps(records))
    return path


def test_prompt_tokens_are_masked_and_the_response_ends_with_eos(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    example = {"instruction": "add two numbers", "input": "two and two", "output": "the sum"}
    tokens = run.tokenize_example(tokenizer, example, max_length=512)
    prompt = tokenizer(run.prompt_of("add two numbers", "two and two"))["input_ids"]
    assert tokens["input_ids"][: len(prompt)] == prompt
    assert tokens["labels"][: len(prompt)] == [run.IGNORE_INDEX] * len(prompt)
    response = tokenizer("the sum", add_special_tokens=False)["input_ids"]
    assert tokens["labels"][len(prompt) :] == response + [tokenizer.eos_token_id]
    assert "### Input:" in run.prompt_of("x", "y") and "### Input:" not in run.prompt_of("x", "")
    short = run.tokenize_example(tokenizer, example, max_length=5)
    assert len(short["input_ids"]) == len(short["labels"]) == 5
    whole = run.tokenize_example(tokenizer, example, max_length=512, train_on_prompt=True)
    assert whole["labels"] == whole["input_ids"] == tokens["input_ids"]


def test_packing_concatenates_and_drops_the_remainder():
    batch = {
        "input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
        "attention_mask": [[1, 1, 1], [1, 1], [1, 1, 1, 1]],
        "labels": [[-100, 2, 3], [-100, 5], [-100, -100, 8, 9]],
    }
    packed = run.pack(batch, block=4)
    assert packed["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert packed["labels"] == [[-100, 2, 3, -100], [5, -100, -100, 8]]


def _run(tiny_model, alpaca_file, out, *extra):
    args = [
        "--model_name_or_path", str(tiny_model),
        "--data_path", str(alpaca_file),
        "--output_dir", str(out),
        "--max_seq_length", "64",
        "--validation_split_percentage", "20",
        "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8",
        "--max_steps", "4",
        "--learning_rate", "1e-2",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "0",
        "--lora_r", "4",
        *extra,
    ]  # fmt: skip
    return run.main(args)


def test_lora_patched_and_unpatched_runs_write_their_results(tiny_model, alpaca_file, tmp_path):
    baseline = _run(tiny_model, alpaca_file, tmp_path / "base", "--no_actq")
    patched = _run(
        tiny_model, alpaca_file, tmp_path / "uniform", "--recipe", "uniform", "--bits", "4"
    )
    for result, out in ((baseline, tmp_path / "base"), (patched, tmp_path / "uniform")):
        on_disk = json.loads((out / "actq_results.json").read_text())
        assert on_disk["eval_loss"] == result["eval_loss"] and result["eval_loss"] > 0
        assert (out / "actq_results.md").read_text().startswith(f"# {tiny_model}")
        assert result["steps"] == 4 and len(result["loss_history"]) == 4
        assert result["training"]["method"] == "lora" and result["training"]["eval_examples"] == 8
        assert 0 < result["parameters"]["trainable"] < result["parameters"]["total"]
        assert result["step_peak_bytes"] > 0 and result["activation_bytes_step0"] > 0
    assert baseline["recipe"] == "baseline" and patched["recipe"] == "uniform-4"
    assert patched["actq"]["codec"] == "uniform" and baseline["actq"] is None
    assert patched["activation_bytes_step0"] < baseline["activation_bytes_step0"]
    # The same data, split and LoRA initialisation: the first steps' losses agree closely.
    first = baseline["loss_history"][0][1], patched["loss_history"][0][1]
    assert abs(first[0] - first[1]) < 1e-3 * abs(first[0])


def test_full_fine_tuning_with_packing_saves_a_model_that_loads(tiny_model, alpaca_file, tmp_path):
    from transformers import AutoModelForCausalLM

    result = _run(
        tiny_model, alpaca_file, tmp_path, "--no_use_lora", "--packing", "--recipe", "fewbit",
        "--train_on_prompt", "--save_model",
    )  # fmt: skip
    assert result["training"]["method"] == "full" and result["training"]["packing"]
    assert result["parameters"]["trainable"] == result["parameters"]["total"]
    assert result["recipe"] == "fewbit-3" and torch.isfinite(torch.tensor(result["eval_loss"]))
    # The saved model is the trained one, unpatched: it loads and differs from the start.
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained.state_dict()[weight], start.state_dict()[weight])
    assert not any("actq" in type(m).__name__.lower() for m in trained.modules())


def test_examples_with_no_response_token_left_are_dropped_and_counted(
    tiny_model, alpaca_file, tmp_path
):
    # Half the prompts (those with an input) are longer than --max_seq_length: their
    # responses are cut off entirely, which would make batches with no supervised token.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    short = len(tokenizer(run.prompt_of("name a colour", ""))["input_ids"])
    long = len(tokenizer(run.prompt_of("add two numbers", "two and two"))["input_ids"])
    assert long > short + 2
    result = _run(
        tiny_model, alpaca_file, tmp_path, "--recipe", "uniform", "--bits", "4",
        "--max_seq_length", str(short + 2), "--per_device_train_batch_size", "1",
    )  # fmt: skip
    dropped = result["training"]["dropped_examples"]
    # 40 examples, 8 of them held out (shuffled), 20 with an input: those 20 are dropped.
    assert dropped["training"] + dropped["held-out"] == 20
    assert result["training"]["train_examples"] == 32 - dropped["training"]
    assert result["training"]["eval_examples"] == 8 - dropped["held-out"]
    assert all(math.isfinite(loss) for _, loss in result["loss_history"])
    assert math.isfinite(result["eval_loss"])
    assert not run.has_supervised_token({"labels": [5, -100, -100]})  # the first never counts
    assert run.has_supervised_token({"labels": [-100, -100, 7]})


def test_bad_data_is_reported_clearly(tiny_model, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"prompt": "x", "completion": "y"}]))
    with pytest.raises(ValueError, match="need 'instruction' and 'output'"):
        _run(tiny_model, path, tmp_path / "out")


@pytest.mark.parametrize("flag", ["model", "data"])
def test_a_missing_local_path_stops_in_one_line_naming_its_flag(
    flag, tiny_model, alpaca_file, tmp_path
):
    missing = tmp_path / "not-there" / ("model" if flag == "model" else "alpaca.json")
    model, data = (missing, alpaca_file) if flag == "model" else (tiny_model, missing)
    with pytest.raises(SystemExit) as stopped:
        _run(model, data, tmp_path / "out")
    message = str(stopped.value.code)
    assert "\n" not in message and message.startswith("run.py: --")
    assert f"{'model_name_or_path' if flag == 'model' else 'data_path'} '{missing}'" in message
    assert "does not exist" in message and "hub id" in message


@pytest.mark.slow
def test_qlora_on_cpu(alpaca_file, tmp_path):
    pytest.importorskip("bitsandbytes")
    # 64 and 128 wide: on CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights for
    # evaluation in blocks of 64 input features and fails on narrower layers.
    model = _save_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128)
    result = _run(
        model, alpaca_file, tmp_path / "out", "--qlora", "--recipe", "uniform", "--bits", "4",
        "--gradient_checkpointing",
    )  # fmt: skip
    assert result["training"]["method"] == "qlora"
    assert torch.isfinite(torch.tensor(result["eval_loss"]))
    assert result["activation_bytes_step0"] > 0


ALPACA = Path(__file__).resolve().parents[3] / "shared" / "alpaca" / "alpaca_5000.json"


@pytest.mark.slow
@pytest.mark.skipif(not ALPACA.exists(), reason=f"needs the Alpaca data at {ALPACA}")
def test_convergence_driver_end_to_end_and_its_checkpoint_check(tmp_path, capsys):
    """``convergence.py --quick``: tokenizer and model built, pretrained, fine-tuned, rendered;
    a rerun of pretraining reproduces the recorded checkpoint (or its losses, to rounding), and a
    mismatch stops the run."""
    spec = importlib.util.spec_from_file_location("convergence", RECIPE_DIR / "convergence.py")
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    results, runs = tmp_path / "results", tmp_path / "runs"
    args = ["--quick", "--data", str(ALPACA), "--results", str(results), "--runs", str(runs)]
    args += ["--modes", "lora", "--recipes", "baseline", "uniform-4", "--seeds", "0"]
    convergence.main(args)
    for recipe in ("baseline", "uniform-4"):
        record = json.loads((results / "lora" / f"{recipe}_seed0.json").read_text())
        assert record["steps"] == 2 and len(record["eval_history"]) >= 2
        assert (
            record["checkpoint_sha256"]
            == json.loads((results / "pretrain.json").read_text())["checkpoint_sha256"]
        )
    table = (results / "table.md").read_text()
    assert "| uniform-4 | 1 |" in table and (results / "curves.png").stat().st_size > 0
    # Pretraining again from scratch gives the same weights, so the grid may go on.
    import shutil

    shutil.rmtree(runs / "pretrain")
    convergence.main(args)
    # Another hash with the recorded losses (a rebuild that differs in the last bits) goes on;
    # losses apart by more than rounding are refused.
    record = json.loads((results / "pretrain.json").read_text())
    record["checkpoint_sha256"] = "0" * 64
    (results / "pretrain.json").write_text(json.dumps(record))
    shutil.rmtree(runs / "pretrain")
    capsys.readouterr()
    convergence.main(args)
    assert "reproduced the recorded one to rounding" in capsys.readouterr().out
    record["eval_history"][-1][1] *= 1 + 1e-4
    (results / "pretrain.json").write_text(json.dumps(record))
    shutil.rmtree(runs / "pretrain")
    with pytest.raises(SystemExit, match=r"differs from the committed one \(.*\) by more than"):
        convergence.main(args)


def test_the_committed_table_is_the_render_of_the_committed_results():
    """``tools/results_age.py`` ages the table from the results it shows: that holds only while
    the table is what ``convergence.py --render-only`` makes of them."""
    spec = importlib.util.spec_from_file_location("convergence", RECIPE_DIR / "convergence.py")
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    results = RECIPE_DIR / "results" / "convergence"
    assert (results / "table.md").read_text() == convergence.render(results)
