"""The ``hf-actq memory`` command."""

import json
import re
from pathlib import Path

import pytest
import torch

import hf_actq
from hf_actq.__main__ import main as hf_actq_main
from hf_actq.report.cli import main, parse_size
from hf_actq.report.presets import preset_config


def test_command_prints_the_table_and_writes_outputs(tmp_path, capsys):
    code = main(
        [
            "tiny-llama",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--recipe",
            "fewbit",
            "alam:bits=0.5",
            "--gpu-memory",
            "24GB",
            "--output",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "| baseline | the unpatched model |" in out and "max batch on 24 GiB" in out
    # Each row says its bits and codec, and a legend says what the columns count.
    assert "| fewbit | 3-bit activation derivatives only |" in out
    assert "| alam:bits=0.5 | average quantization (ALAM), 0.5 bits on average" in out
    assert "fits beside the model state in 24 GiB" in out and "docs/memory.md" in out
    assert "independent count (autograd graph walk) agrees within 0.00%" in out
    assert (tmp_path / "memory.json").exists() and (tmp_path / "memory.md").exists()
    # The report names what made it: tools/results_age.py ages it by this commit.
    made_by = json.loads((tmp_path / "memory.json").read_text())["provenance"]
    assert made_by["command"].startswith("hf-actq memory tiny-llama --batch-size 2")
    assert made_by["hf_actq"] and made_by["torch"] == torch.__version__
    if (Path(hf_actq.__file__).resolve().parents[1] / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{7,40}\+?", made_by["commit"])


def test_the_report_names_the_commit_it_started_from(tmp_path, monkeypatch):
    # A run takes minutes to hours: a commit made meanwhile did not make its numbers.
    import hf_actq.report
    from hf_actq.report import provenance

    measuring = []
    monkeypatch.setattr(
        provenance, "checkout_commit", lambda *a: "bbbbbbb" if measuring else "aaaaaaa"
    )
    measure = hf_actq.report.measure_model
    monkeypatch.setattr(
        hf_actq.report, "measure_model", lambda *a, **k: measuring.append(1) or measure(*a, **k)
    )
    args = ["tiny-bert", "--seq-len", "8", "--batch-size", "1", "--recipe", "fewbit"]
    assert main([*args, "--output", str(tmp_path), "--no-progress"]) == 0
    assert measuring
    made_by = json.loads((tmp_path / "memory.json").read_text())["provenance"]
    assert made_by["commit"] == "aaaaaaa"


def test_console_entry_dispatches_memory(capsys):
    assert (
        hf_actq_main(
            [
                "memory",
                "tiny-bert",
                "--seq-len",
                "8",
                "--batch-size",
                "1",
                "--recipe",
                "fewbit",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "| fewbit |" in capsys.readouterr().out


def test_local_model_directory(tmp_path, capsys):
    preset_config("tiny-llama").save_pretrained(tmp_path)
    args = [str(tmp_path), "--batch-size", "1", "--seq-len", "8", "--recipe", "uniform:bits=4"]
    assert main([*args, "--dtype", "bf16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(llama, 2 layers)" in out and "bfloat16" in out and "| uniform:bits=4 |" in out


def test_unknown_model_and_sizes_are_reported():
    with pytest.raises(SystemExit, match="is not a preset"):
        main(["bert-huge"])
    with pytest.raises(SystemExit, match="recipe"):
        main(["tiny-bert", "--recipe", "fast", "--no-progress"])
    assert parse_size("80GiB") == 80 * 2**30 == parse_size("80GB") == parse_size("80G")
    assert parse_size("512MiB") == 512 * 2**20


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--output", "{file}"], "--output '{file}' cannot be a directory"),
        (["--device", "meta"], "--device: expected cpu, cuda or cuda:N, got 'meta'"),
        (["--batch-size", "0"], "--batch-size: expected a positive integer, got '0'"),
    ]
    + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA device")]),
)
def test_mistakes_are_one_line_before_any_measuring(arguments, says, tmp_path, capsys, monkeypatch):
    # --output naming a file used to fail with a traceback after the whole measurement, and
    # --device meta deep inside it.
    existing = tmp_path / "a-file"
    existing.write_text("")
    monkeypatch.setattr("hf_actq.report.measure_model", lambda *a, **k: pytest.fail("measured"))
    arguments = [a.format(file=existing) for a in arguments]
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-bert", "--no-progress", *arguments])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-actq memory: ")
    assert says.format(file=existing) in err
