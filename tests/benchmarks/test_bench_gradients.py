"""benchmarks/bench_gradients.py: its adaptive rows measure ALAM's plan with every tensor
measured, whatever the machine's speed, so that a re-run reproduces them."""

import sys
from pathlib import Path

import hf_actq
from hf_actq import ActQConfig
from hf_actq.testing import tiny_batch, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gradients  # noqa: E402


def test_the_plans_measure_every_tensor_however_slow_the_machine():
    model = tiny_model("bert", num_hidden_layers=1)
    # A cap that any machine overruns: the library's pass would stop after the first tensor.
    config = ActQConfig.from_recipe("alam", bits=1, calibration_seconds=1e-9)
    handle = hf_actq.apply(model, config)
    capped = handle.calibrate(tiny_batch("bert"))
    assert capped.info["estimated"] > 0
    plan = bench_gradients.calibrate_fully(handle, tiny_batch("bert"))
    assert plan.info["estimated"] == 0
    assert plan.info["measured"] == capped.info["measured"] + capped.info["estimated"]
