"""The GPU check (benchmarks/gpu/check.sh) dry-run on CPU: tiny shapes, the kernels under the
Triton interpreter, every part through the code a lent GPU runs, so that it cannot rot between
loans."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 60 s: every part of the older full check (speed.sh is the short one)
def test_the_gpu_check_runs_every_part_and_writes_its_tables(tmp_path):
    pytest.importorskip("triton")  # its kernels part runs them under the interpreter
    # Every part and the summary in one process (``all``): what check.sh runs part by part,
    # without three more start-ups of torch and transformers; check.sh's loop is tested below.
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu/check.py", "all", "--out", str(tmp_path), "--dry-run"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = {
        p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ("tests", "kernels", "steps")
    }
    for data in parts.values():
        env_info = data["environment"]
        assert env_info["dry_run"] and env_info["torch"] and env_info["triton"]
        assert data["commit"]  # this checkout's, for tools/results_age.py
    (tests,) = parts["tests"]["rows"]
    assert (tests["passed"], tests["failed"], tests["exit status"]) == (1, 0, 0)
    kernels = parts["kernels"]["rows"]
    assert len(kernels) == 10 and {r["dtype"] for r in kernels} == {"fp32"}
    # Under the interpreter every kernel gives its twin's bits, but the norm backward, whose
    # reductions sum in another order (one fp32 rounding), and the rotated codec, whose fp32
    # tiles are rotated in three bf16 parts (fp32 sums in another order than the twin's).
    for row in kernels:
        bound = {"LayerNorm": 1e-6, "rotated": 1e-5}.get(row["kernel"].split()[0], 0.0)
        assert row["max |kernel - twin|"] <= bound, row
        assert row["ms"] > 0 and row["reference ms"] > 0 and row["host ms"] > 0
    steps = parts["steps"]["rows"]
    assert len(steps) == 3 * 6
    assert all(r["step ms"] > 0 and r["peak MiB"] > 0 and r["host ms"] > 0 for r in steps)
    # A profile of every kernel case and of each recipe's step on the first model, for the
    # session after a loan to see where a slow case spends its time.
    profiles = sorted(p.name for p in tmp_path.glob("profile-*.txt"))
    assert len(profiles) == 10 + 6, profiles
    gelu = (tmp_path / "profile-kernel-few-bit-gelu-3-bit-fwd-bwd-vs-torch.txt").read_text()
    assert "hf_actq::fewbit_forward" in gelu and "hf_actq::fewbit_backward" in gelu
    summary = (tmp_path / "summary.md").read_text()
    assert "kernels bit-identical with their twins: 8 of 10" in summary  # see the bounds above
    assert "# GPU check: steps" in summary and "Dry run" in summary


def test_check_sh_runs_each_part_under_its_limit_then_the_summary(tmp_path):
    # A stand-in interpreter records each call and writes what a part writes (its JSON and a
    # log); the second part fails before writing, as a part that hangs or crashes would, and the
    # parts after it and the summary still run.
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {calls}\n'
        '[[ "$2" == kernels ]] && exit 3\n'
        '[[ "$2" == report ]] && { echo summary > "$4/summary.md"; exit 0; }\n'
        'echo "{}" > "$4/$2.json"; echo log > "$4/$2.log"\n'
    )
    python.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(python))
    done = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["check: part kernels ended with status 3"]
    lines = calls.read_text().splitlines()
    parts = ("tests", "kernels", "steps", "report")
    assert [line.split()[1] for line in lines] == list(parts)
    # Every part writes into one scratch folder, outside $OUT, removed at the end.
    (work,) = {line.split()[3] for line in lines}
    assert lines == [f"benchmarks/gpu/check.py {part} --out {work} --dry-run" for part in parts]
    assert not Path(work).exists() and not Path(work).is_relative_to(out)
    # A lent device returns at most 8 files: $OUT holds the JSON of each part that wrote one,
    # the summary and one archive of everything.
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.tar.gz", "steps.json", "summary.md", "tests.json"
    ]  # fmt: skip
    with tarfile.open(out / "gpu-check.tar.gz") as archive:
        names = sorted(Path(name).name for name in archive.getnames() if name != ".")
    assert names == ["steps.json", "steps.log", "summary.md", "tests.json", "tests.log"]


def test_the_summary_names_a_kernel_that_fell_back_and_does_not_count_it_identical(tmp_path):
    # What a GPU run where one kernel failed to compile writes: the twin ran in its place, so
    # its comparison (twin against twin) proves nothing.
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    row = {"max |kernel - twin|": 0.0, "ratio": 1.0, "goal": None, "met": None}
    rows = [
        dict(row, kernel="few-bit gelu", dtype="fp32", **{"kernels fallen back by then": ""}),
        dict(row, kernel="uniform 4-bit", dtype="fp32",
             **{"kernels fallen back by then": "aq_quantize"}),
    ]  # fmt: skip
    env = {"device": "H200", "cuda": "13.0", "torch": "2.11", "triton": "3.6", "date": "today"}
    data = {"part": "kernels", "commit": "abc1234", "environment": env, "rows": rows, "note": ""}
    data["kernels that fell back"] = {"aq_quantize": "CompilationError: no"}
    (tmp_path / "kernels.json").write_text(json.dumps(data))
    summary = check.report(tmp_path)
    assert "- kernel aq_quantize failed, its twin ran instead: CompilationError: no" in summary
    assert "- kernels bit-identical with their twins: 1 of 2" in summary


def test_a_rerun_selects_what_did_not_pass_before(tmp_path, monkeypatch):
    # --rerun tests-<n>.jsonl: the kernel selection runs again without what passed (or was
    # skipped) on the last loan, so that a second short loan reaches what the first did not.
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import check
    finally:
        sys.path.pop(0)
    # pytest collects the selection once (a start-up of torch: about 7 s); both calls read it.
    collections, run = [], subprocess.run

    def collect_once(*args, **kwargs):
        if not collections:
            collections.append(run(*args, **kwargs))
        return collections[0]

    monkeypatch.setattr(check.subprocess, "run", collect_once)
    selection = ["tests/kernels/test_reference.py"]
    listed = check._not_passed(selection, {}, tmp_path / "none.jsonl")
    assert len(listed) > 3 and all(t.startswith(selection[0] + "::") for t in listed)
    earlier = tmp_path / "tests-1.jsonl"
    outcomes = ["passed", "skipped", "failed"]
    earlier.write_text(
        "".join(json.dumps({"test": t, "outcome": o}) + "\n" for t, o in zip(listed, outcomes))
    )
    assert check._not_passed(selection, {}, earlier) == listed[2:]


def test_the_speed_check_times_this_tree_and_its_baseline_side_by_side(tmp_path):
    """benchmarks/gpu/speed.sh on the CPU (--dry-run, kernels only): each tree's hf_actq is the
    one timed, and speed.md sets them side by side. Every case runs once, in this tree alone
    (below); the two trees side by side time the case ``--match`` selects."""
    import shutil

    pytest.importorskip("triton")
    baseline = tmp_path / "baseline"
    shutil.copytree(ROOT / "hf_actq", baseline / "hf_actq")
    (baseline / "COMMIT").write_text("base000\n")
    env = dict(os.environ, OUT=str(tmp_path / "out"), BASELINE=str(baseline), ROUNDS="1")
    env["PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", "benchmarks/gpu/speed.sh", "--dry-run", "--no-steps", "--match",
         "few-bit gelu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {
        label: json.loads((tmp_path / "out" / f"speed-{label}-1.json").read_text())
        for label in ("new", "base")
    }
    assert runs["new"]["hf_actq"] == str(ROOT / "hf_actq")
    assert runs["base"]["hf_actq"] == str(baseline / "hf_actq")
    assert runs["base"]["commit"] == "base000"
    for data in runs.values():
        assert {row["case"] for row in data["kernels"]} == {"few-bit gelu 3-bit fwd+bwd"}
        assert all(row["device us"] > 0 and row["host us"] > 0 for row in data["kernels"])
    table = (tmp_path / "out" / "speed.md").read_text()
    assert "| few-bit gelu 3-bit fwd+bwd | fp32 |" in table and "nan" not in table
    # Where the fused few-bit forward's output came from (on the CPU: never probed, PyTorch's).
    verdicts = runs["new"]["fused few-bit forward"]
    assert verdicts == {"gelu float32": "PyTorch's output"}
    assert "- gelu float32: PyTorch's output" in table


# Every case interpreted (25-30 s): slow; the side-by-side run above takes one of them through
# the same code in the default suite.
@pytest.mark.slow
def test_the_speed_check_runs_every_kernel_case(tmp_path):
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu/speed.py", "--dry-run", "--no-steps", "--out",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "speed-new-1.json").read_text())
    cases = {row["case"] for row in data["kernels"]}
    assert {"few-bit gelu 3-bit fwd+bwd", "uniform 4-bit pack+unpack"} <= cases
    assert "RMSNorm, 4-bit x_hat, fwd+bwd" in cases
    # The rotated codec both ways: its fused kernels and the composition they replace.
    assert {"rotated 4-bit pack+unpack", "rotated 4-bit pack+unpack, rotation outside "
            "the kernels"} <= cases  # fmt: skip
    assert all(row["device us"] > 0 and row["host us"] > 0 for row in data["kernels"])
    assert data["fused few-bit forward"] == {
        "gelu float32": "PyTorch's output",
        "silu float32": "PyTorch's output",
    }


@pytest.mark.slow  # 30 s of compiles: run with -m slow before a GPU session
def test_the_graphed_step_times_each_recipe_against_the_unpatched_compiled_step(tmp_path):
    """benchmarks/gpu/graphed.py on the CPU (--dry-run: tiny shapes, aot_eager): the unpatched
    step and each recipe compiled alike in one run, ratios to the first, graph skips counted."""
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu/graphed.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "graphed.json").read_text())["rows"]
    assert [row["recipe"] for row in rows] == ["baseline", "fewbit", "uniform"]
    assert rows[0]["time ratio"] == 1.0
    assert all(row["step ms"] > 0 and "cudagraph skips" in row for row in rows)
    assert "| uniform |" in (tmp_path / "graphed.md").read_text()
