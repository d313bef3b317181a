"""A Triton kernel that fails to compile or launch never ends a user's training: one warning
names it, and its PyTorch twin runs from then on, giving the twin's results."""

import contextlib
import copy
import logging

import pytest
import torch

import hf_actq
import hf_actq.kernels as kernels
from hf_actq import ActQConfig
from hf_actq.kernels import registry
from hf_actq.kernels.average_quant import aq_quantize_reference
from hf_actq.testing import tiny_llama


@pytest.fixture
def failing_kernels(monkeypatch):
    with _fail_every_kernel(monkeypatch) as calls:
        yield calls


@contextlib.contextmanager
def _fail_every_kernel(monkeypatch):
    """Every launcher raises as a compile failure would, and CPU tensors take the CUDA path
    (dispatch, dtype check, fallback); yields the launchers' call counts."""
    calls = dict.fromkeys(registry.KERNELS, 0)
    for name, kernel in registry.KERNELS.items():

        def fail(*args, _name=name, **kwargs):
            calls[_name] += 1
            raise RuntimeError(f"simulated compile failure in {_name}")

        monkeypatch.setattr(kernel, "launcher", fail)
    monkeypatch.setattr(registry, "triton_enabled", lambda: True)
    monkeypatch.setattr(registry, "FAILED", {})
    with registry.kernels_on_cpu():
        yield calls


def test_a_failing_kernel_warns_once_and_its_twin_runs_from_then_on(failing_kernels, caplog):
    x = torch.randn(6, 256)
    expected = aq_quantize_reference(x, 1, 4, 128, True, 7)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        for _ in range(3):
            got = kernels.aq_quantize(x, 1, 4, 128, True, 7)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert failing_kernels["aq_quantize"] == 1  # never tried again
    warnings = [r.getMessage() for r in caplog.records if "Triton kernel" in r.getMessage()]
    assert len(warnings) == 1
    assert "hf_actq::aq_quantize failed (RuntimeError: simulated" in warnings[0]
    assert "its PyTorch twin runs instead" in warnings[0]


def test_cpu_tensors_take_the_kernel_path_only_inside_kernels_on_cpu(monkeypatch):
    x = torch.randn(300, device="cpu")
    expected = kernels.mask_pack(x)
    seen = []
    kernel = registry.KERNELS["mask_pack"]
    monkeypatch.setattr(kernel, "launcher", lambda source: seen.append(source) or kernel.twin(x))
    monkeypatch.setattr(registry, "triton_enabled", lambda: True)
    with registry.kernels_on_cpu():
        assert torch.equal(kernels.mask_pack(x), expected)
    assert len(seen) == 1
    assert torch.equal(kernels.mask_pack(x), expected)
    assert len(seen) == 1  # the CPU registration left with the context


def _bert():
    from hf_actq.testing import tiny_bert

    return tiny_bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


ALWAYS = {"fewbit_forward", "fewbit_backward", "norm_backward"}
# case: (model, config, the kernels its step runs); together they run every launcher.
CASES = {
    "llama-uniform": (
        lambda: tiny_llama(hidden_act="gelu"),
        ActQConfig.from_recipe("uniform"),
        {"aq_quantize", "aq_dequantize", "gated_forward", "gated_backward"}
        | {"norm_pack", "norm_backward_packed"}
        | ALWAYS,
    ),
    # Memory-sharing norms: x_hat rebuilt from the output inside the backward kernels.
    "llama-fewbit": (
        tiny_llama,
        ActQConfig.from_recipe("fewbit"),
        {"fewbit_forward", "fewbit_backward", "norm_backward_from_output"},
    ),
    "bert-blpa-masks": (
        _bert,
        ActQConfig(bits=4, codec="blpa", dropout_mode="mask"),
        {"blpa_quantize", "blpa_dequantize"} | {"mask_pack", "mask_unpack"} | ALWAYS,
    ),
    # Packed checkpointing keeps each layer's input rotated (every coefficient kept) and the
    # rest as "uniform" does; it recomputes the activations (no few-bit codes).
    "bert-checkpoint": (
        _bert,
        ActQConfig.from_recipe("checkpoint"),
        {"rotated_quantize", "rotated_dequantize", "aq_quantize", "aq_dequantize"}
        | {"norm_pack", "norm_backward_packed", "seeded_dropout"},
    ),
    "bert-smaq-seeds": (
        _bert,
        ActQConfig(codec="smaq", bits=8),
        {"smaq_quantize", "smaq_dequantize"} | {"seeded_dropout"} | ALWAYS,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_goes_on_with_the_twins_when_every_kernel_fails(case, monkeypatch, caplog):
    make, config, kernels_run = CASES[case]
    model = make()
    ids = torch.randint(
        3, 100, (2, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(0)
    )
    labels = torch.tensor([0, 1]) if case.startswith("bert") else ids

    def step(m):
        torch.manual_seed(0)
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    twins = copy.deepcopy(model)
    handle = hf_actq.apply(twins, config)
    with monkeypatch.context() as twins_only:  # on a GPU too, where kernels would run
        twins_only.setattr(registry, "triton_enabled", lambda: False)
        expected = step(twins)
    handle.revert()
    handle = hf_actq.apply(model, config)
    with _fail_every_kernel(monkeypatch) as failing, caplog.at_level(logging.WARNING, "hf_actq"):
        got = step(model)
        step(model)  # the failed kernels are not tried again
    handle.revert()
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    tried = {name for name, count in failing.items() if count}
    assert tried == kernels_run
    assert all(count == 1 for count in failing.values() if count)
    assert set(registry.FAILED) == tried
    warned = [r for r in caplog.records if "Triton kernel" in r.getMessage()]
    assert len(warned) == len(tried)


def test_the_cases_run_every_launcher():
    assert set().union(*(case[2] for case in CASES.values())) == set(registry.KERNELS)


def test_without_triton_the_package_imports_and_the_twins_run():
    """A CPU install without Triton: every op file still imports (its kernels defined as plain
    functions that nothing launches), and the ops run their twins."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['triton'] = None  # import triton raises ImportError\n"
        "import torch, hf_actq\n"
        "from hf_actq import kernels\n"
        "assert not kernels.triton_available() and len(kernels.KERNELS) == 19\n"
        "x = torch.randn(100)\n"
        "assert torch.equal(kernels.mask_unpack(kernels.mask_pack(x), [100], torch.bool), x != 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


LAUNCHERS_OUTSIDE_THE_INTERPRETER = """
import torch, hf_actq
from hf_actq import ActQConfig, kernels
from hf_actq.testing import host_budget, tiny_bert, tiny_llama

launched = set()
for make, config in (
    (tiny_llama, ActQConfig.from_recipe("uniform")),
    (tiny_bert, ActQConfig.from_recipe("checkpoint")),
    (tiny_bert, ActQConfig(bits=4, codec="blpa", dropout_mode="mask")),
    (tiny_bert, ActQConfig(codec="smaq", bits=8)),
    (tiny_bert, ActQConfig.from_recipe("fewbit")),  # memory-sharing norms
):
    model = make().to(torch.bfloat16)
    hf_actq.apply(model, config)
    ids = torch.randint(3, 100, (2, 16))
    labels = torch.tensor([0, 1]) if make is tiny_bert else ids
    with host_budget() as budget:
        model(input_ids=ids, labels=labels).loss.backward()
    launched |= set(budget.triton_launches)
assert not kernels.FAILED, kernels.FAILED
print(sorted(launched))
"""


def test_the_launchers_run_outside_the_interpreter():
    """A GPU runs the launchers without ``TRITON_INTERPRET`` (the suite sets it): their host
    code, run here with the kernels stubbed, must not fail there. A launcher that read
    ``triton.runtime.interpreter`` (imported only in interpreter mode) fell back to its twin on
    every GPU."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")  # the kernels stubbed, the launchers run
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHERS_OUTSIDE_THE_INTERPRETER],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    launched = set(eval(done.stdout.strip().splitlines()[-1]))  # noqa: S307 (our own output)
    assert {"rotated_quantize_kernel", "rotated_dequantize_kernel"} <= launched
    assert {"blpa_quantize_kernel", "smaq_quantize_kernel", "gated_forward_kernel"} <= launched
    # q, k or v at 16 tokens, head dim 8: LLaMA's under "uniform", BERT's under BLPA.
    assert {"aq_quantize_strided_kernel", "blpa_quantize_strided_kernel"} <= launched
