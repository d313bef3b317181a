import subprocess
import sys

import pytest

from hf_actq import demo


def test_demo_saves_gelu_bytes_and_trains_alike():
    result = demo.run(bits=3, steps=4, batch_size=4, seq_len=32)
    assert result["patched"] == [
        "bert.encoder.layer.0.intermediate.intermediate_act_fn",
        "bert.encoder.layer.1.intermediate.intermediate_act_fn",
    ]
    act = result["activation_slot_bytes"]
    # Two GELU inputs of 4 x 32 x 512 fp32 vs their 3-bit codes (+ tiny metadata).
    assert act["baseline"] == 2 * 4 * 32 * 512 * 4
    assert act["fewbit"] <= 2 * (4 * 32 * 512 * 3 // 8 + 1024)
    saved = result["saved_bytes"]
    assert saved["baseline"] - saved["fewbit"] == act["baseline"] - act["fewbit"]
    losses = result["losses"]
    assert losses["baseline"][0] == losses["fewbit"][0]  # identical forward
    assert abs(losses["baseline"][-1] - losses["fewbit"][-1]) < 0.05


@pytest.mark.slow  # 12 s in a fresh process; the demo itself runs in the test above
def test_console_command_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "hf_actq", "demo", "--steps", "2", "--batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "GELU slots" in proc.stdout and "activation memory saved" in proc.stdout


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--bits", "99"], "--bits: expected an integer in 1..4 (few-bit derivatives), got '99'"),
        (["--bits", "6"], "--bits: expected an integer in 1..4"),  # it printed 6, ran 4
        (["--steps", "0"], "--steps: expected a positive integer, got '0'"),
        (["--batch-size", "0"], "--batch-size: expected a positive integer, got '0'"),
        (["--seq-len", "100000"], "--seq-len: expected an integer in 1..256"),
    ],
)
def test_mistakes_are_one_line_before_any_training(arguments, says, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run", lambda *a: pytest.fail("trained"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(arguments)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
