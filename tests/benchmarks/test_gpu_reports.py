"""benchmarks/gpu/reports.sh: the memory reports a lent GPU re-runs. Its commands must still
parse, name the committed results they replace, and run in order while the budget lasts."""

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from hf_actq.report.cli import build_parser
from hf_actq.report.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]


def _reports() -> list[str]:
    done = subprocess.run(
        ["bash", "benchmarks/gpu/reports.sh", "--list"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def _output(report: str) -> str:
    words = shlex.split(report)
    return words[words.index("--output") + 1]


def _run_reports(tmp_path, stand_in: str, budget: int):
    """reports.sh with ``stand_in`` (bash) as its Python; its output and $OUT."""
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\n" + stand_in)
    python.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(python), BUDGET=str(budget))
    done = subprocess.run(
        ["bash", "benchmarks/gpu/reports.sh"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done, out


# The config folders reports.sh writes (benchmarks/gpu/report_configs.py) for the reports that
# name a folder, not a preset.
CONFIG_FOLDERS = (
    "gemma3-1b-v32k", "gemma3-2l", "gemma4-text-defaults", "qwen3_5-text-defaults",
)  # fmt: skip
CONFIGS_CALL = "benchmarks/gpu/report_configs.py --out ."


def test_every_report_parses_and_replaces_a_committed_result():
    reports = _reports()
    assert len(reports) == 6
    for report in reports:
        words = shlex.split(report)
        assert (ROOT / _output(report)).exists(), report
        if words[:3] == ["-m", "hf_actq", "memory"]:
            args = build_parser().parse_args(words[3:])
            if args.model in CONFIG_FOLDERS:
                assert args.dtype == "bf16", report
            else:
                assert args.model in PRESETS and args.dtype is None, report  # the preset's bf16
        else:
            assert words[0] == "benchmarks/bench_memory.py" and (ROOT / words[0]).exists()


def test_reports_run_in_order_while_the_budget_lasts_and_come_back_in_one_archive(tmp_path):
    # A stand-in interpreter records each call and fails the second report; the others
    # finish, and their results (here the committed ones) and every log are archived.
    calls = tmp_path / "calls"
    stand_in = f'echo "$*" >> {calls}\necho "ran $*"\n[[ "$*" == *checkpoint* ]] && exit 4\n'
    done, out = _run_reports(tmp_path, stand_in + "exit 0\n", budget=600)
    reports = _reports()
    assert calls.read_text().splitlines() == [CONFIGS_CALL, *reports]
    outputs = [_output(r) for r in reports]
    failed = outputs[1]
    assert done.stdout.splitlines() == [
        f"reports: {o} done" if o != failed else f"reports: {o} ended with status 4 (log in the archive)"
        for o in outputs
    ]  # fmt: skip
    assert [p.name for p in out.iterdir()] == ["reports.tar.gz"]
    with tarfile.open(out / "reports.tar.gz") as archive:
        names = archive.getnames()
        logs = sorted(n for n in names if n.startswith("reports-logs/"))
        log = archive.extractfile("reports-logs/memory_llama2_7b_lora_alam1.log").read().decode()
    for output in outputs:
        assert (output in names) == (output != failed), output
    assert len(logs) == len(reports) + 1 and log == f"ran {reports[0]}\n"
    assert "reports-logs/report_configs.log" in logs


def test_reports_past_the_budget_are_not_started(tmp_path):
    done, out = _run_reports(tmp_path, "exit 0\n", budget=10)
    assert done.stdout.splitlines() == [
        f"reports: no time left for {_output(r)}" for r in _reports()
    ]
    with tarfile.open(out / "reports.tar.gz") as archive:
        assert archive.getnames() == ["reports-logs"]  # nothing ran: no result, no log


def test_the_config_folder_builds_the_model_the_committed_report_measured(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    subprocess.run(
        [sys.executable, *CONFIGS_CALL.replace("--out .", f"--out {tmp_path}").split()],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, timeout=120,
        check=True,
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == list(CONFIG_FOLDERS)
    committed = json.loads(
        (ROOT / "benchmarks/results/memory_gemma3_1b_v32k_all_layers/memory.json").read_text()
    )
    config = AutoConfig.from_pretrained(tmp_path / "gemma3-1b-v32k")
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == (
        committed["model_type"], committed["num_layers"], 32768,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Every weight trains in bf16: the committed baseline's gradients are 2 bytes a parameter.
    (baseline,) = [r for r in committed["results"] if r["label"] == "baseline"]
    params = sum(p.numel() for p in model.parameters())
    assert 2 * params == baseline["measurement"]["grad_bytes"]
