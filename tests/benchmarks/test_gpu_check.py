"""The GPU check (benchmarks/gpu/check.sh) dry-run on CPU: tiny shapes, the kernels under the
Triton interpreter, every part through the code a lent GPU runs, so that it cannot rot between
loans."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_every_part_and_writes_its_tables(tmp_path):
    # The interpreter running the tests, whether or not its environment is activated.
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ended with status" not in done.stdout, done.stdout
    parts = {
        p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ("tests", "kernels", "steps")
    }
    for data in parts.values():
        env_info = data["environment"]
        assert env_info["dry_run"] and env_info["torch"] and env_info["triton"]
    (tests,) = parts["tests"]["rows"]
    assert (tests["passed"], tests["failed"], tests["exit status"]) == (1, 0, 0)
    kernels = parts["kernels"]["rows"]
    assert len(kernels) == 10 and {r["dtype"] for r in kernels} == {"fp32"}
    # Under the interpreter every kernel gives its twin's bits, but the norm backward, whose
    # reductions sum in another order (one fp32 rounding).
    for row in kernels:
        bound = 1e-6 if row["kernel"].startswith("LayerNorm") else 0.0
        assert row["max |kernel - twin|"] <= bound, row
        assert row["ms"] > 0 and row["reference ms"] > 0
    steps = parts["steps"]["rows"]
    assert len(steps) == 3 * 6
    assert all(r["step ms"] > 0 and r["peak MiB"] > 0 for r in steps)
    summary = (tmp_path / "summary.md").read_text()
    assert "kernels bit-identical with their twins: 9 of 10" in summary
    assert "# GPU check: steps" in summary and "Dry run" in summary
