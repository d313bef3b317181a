"""benchmarks/bench_attention_backward.py: its "saved LSE" path is SDPA's own fused backward with
the saved q, k, v and output swapped, so that with nothing rounded it is the exact gradient, and
every difference it reports comes from the rounding."""

import sys
from pathlib import Path

import torch

from hf_actq.codecs import uniform
from hf_actq.testing import tiny_batch, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_attention_backward as bench  # noqa: E402


def _layers():
    model = tiny_model("bert", attn_implementation="sdpa")
    batch = tiny_batch("bert")
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, 9:] = 0  # padding: the mask reaches the captured calls
    return bench.capture_layers(model, batch)


def test_the_saved_lse_backward_of_unrounded_tensors_is_the_exact_gradient():
    layers = _layers()
    assert len(layers) == 2 and all(r["mask"] is not None and "grad" in r for r in layers)
    nodes = set()
    for record in layers:
        exact, out = bench.gradients(record, record["qkv"], torch.float32)
        got = bench._saved_lse_backward(record, torch.float32, record["qkv"], out, nodes)
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)
        codec = uniform(2)
        rounded = [codec.unpack(codec.pack(t.contiguous(), 7)).view(t.shape) for t in record["qkv"]]
        assert not torch.allclose(
            bench._saved_lse_backward(record, torch.float32, rounded, None, nodes), exact
        )
    # The fused kernel's node, whose saved tensors are q, k, v, its output and the LSE.
    assert nodes == {"ScaledDotProductFlashAttentionForCpuBackward0"}


def test_measure_writes_each_path_against_recomputing():
    results = bench.measure(_layers(), bits_list=(4,), dtypes=("float32",))
    row = results["float32, 4 bits"]
    assert 0 < row["re-run"] < 1
    assert row["saved LSE / re-run"] == row["saved LSE"] / row["re-run"]
    assert results["backward nodes"] == ["ScaledDotProductFlashAttentionForCpuBackward0"]
