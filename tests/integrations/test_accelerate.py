"""Two processes under ``accelerate launch`` (CPU, gloo), DDP and FSDP2: identical patching on
both ranks, and training steps that keep the ranks in agreement."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("accelerate")


FSDP2 = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "LlamaDecoderLayer",
]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_run_patches_both_ranks_identically(tmp_path, mode):
    launcher = shutil.which("accelerate")
    if launcher is None:
        pytest.skip("the accelerate launcher is not on PATH")
    script = Path(__file__).with_name("accelerate_script.py")
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [
            launcher,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(script),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["patched"] == ranks[1]["patched"] and ranks[0]["patched"]
    # DDP keeps the replicas in sync; FSDP2's sum is over the full (sharded) tensor.
    assert ranks[0]["weight_sum"] == ranks[1]["weight_sum"]
    assert all(loss == loss for r in ranks for loss in r["losses"])  # no NaN
