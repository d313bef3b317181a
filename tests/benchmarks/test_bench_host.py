"""benchmarks/bench_host.py runs (a few repeats) and writes its rows: kept from rotting between
the runs that record its figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 10 s: a benchmark's dry run
def test_bench_host_times_each_op_against_stock(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "host.json"
    done = subprocess.run(
        [sys.executable, "bench_host.py", "--repeats", "3", "--output", str(out)],
        cwd=ROOT / "benchmarks", env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["op"] for row in rows} >= {"Linear 64x64", "GELU, 3-bit derivative"}
    assert all(row["stock us"] > 0 and row["hf_actq us"] > 0 for row in rows)
