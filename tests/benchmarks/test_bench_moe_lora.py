"""benchmarks/bench_moe_lora.py runs at tiny shapes and writes its three modes: kept from rotting
between the runs that record its figures."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_moe_lora_measures_each_mode_against_the_unpatched_block(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_moe_lora

    out = tmp_path / "moe_lora.json"
    shapes = ["--tokens", "64", "--hidden", "64", "--intermediate", "32", "--experts", "4"]
    threads = torch.get_num_threads()
    try:
        bench_moe_lora.main([*shapes, "--top-k", "2", "--rank", "4", "--rounds", "1",
                             "--output", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop("bench_moe_lora", None)
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["unpatched", "folded again", "rank-r path"]
    unpatched = results["unpatched"]
    for mode in ("folded again", "rank-r path"):
        # The op keeps neither the gathered rows nor the merged expert weights.
        assert 0 < results[mode]["saved_bytes"] < unpatched["saved_bytes"]
        assert results[mode]["step_ms"] > 0 and results[mode]["backward"] > 0
