"""Every Triton kernel variant the dispatcher can launch compiles for sm_80 and sm_90.

Runs ``python -m hf_actq.kernels.aot`` in a subprocess without TRITON_INTERPRET (the interpreter
would replace the compiler), which needs no GPU.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_all_kernel_variants_compile_for_sm80_and_sm90(tmp_path):
    from hf_actq.fewbit import ACTIVATIONS
    from hf_actq.kernels.aot import FLOAT_TYPES, INDEX_TYPES, variants

    expected = len(FLOAT_TYPES) * len(INDEX_TYPES) * (len(ACTIVATIONS) + 1)
    assert len(variants()) == expected

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hf_actq.kernels.aot", "--cc", "80", "90", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == 2 * expected
    assert {r["cc"] for r in results} == {80, 90}
    assert all(r["cubin_bytes"] > 0 for r in results)
    labels = {r["variant"] for r in results}
    assert any("fewbit_backward_kernel" in label and "bf16" in label for label in labels)
