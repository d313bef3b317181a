"""A Triton kernel that fails to compile or launch never ends a user's training: one warning
names it, and its PyTorch twin runs from then on, giving the twin's results."""

import copy
import logging

import pytest
import torch

import hf_actq
import hf_actq.kernels as kernels
from hf_actq import ActQConfig
from hf_actq.kernels import reference
from hf_actq.testing import tiny_llama

LAUNCHERS = [
    "fewbit.fewbit_forward_triton",
    "fewbit.fewbit_backward_triton",
    "average_quant.aq_quantize_triton",
    "average_quant.aq_dequantize_triton",
    "sign_preserving.blpa_quantize_triton",
    "sign_preserving.blpa_dequantize_triton",
    "mask.mask_pack_triton",
    "mask.mask_unpack_triton",
    "smaq.smaq_quantize_triton",
    "smaq.smaq_dequantize_triton",
    "dropout.seeded_dropout_triton",
    "norm.norm_backward_triton",
]


@pytest.fixture
def failing_kernels(monkeypatch):
    return _fail_every_kernel(monkeypatch)


def _fail_every_kernel(monkeypatch):
    """Every launcher raises as a compile failure would, and every tensor counts as one the
    kernels would take; returns the launchers' call counts."""
    import importlib

    calls = dict.fromkeys(LAUNCHERS, 0)
    for name in LAUNCHERS:
        module, launcher = name.split(".")

        def fail(*args, _name=name, **kwargs):
            calls[_name] += 1
            raise RuntimeError(f"simulated compile failure in {_name}")

        monkeypatch.setattr(importlib.import_module(f"hf_actq.kernels.{module}"), launcher, fail)
    monkeypatch.setattr(kernels, "uses_triton", lambda tensor, dtypes=None: True)
    monkeypatch.setattr(kernels, "FAILED", {})
    return calls


def test_a_failing_kernel_warns_once_and_its_twin_runs_from_then_on(failing_kernels, caplog):
    x = torch.randn(6, 256)
    expected = reference.aq_quantize_reference(x, 1, 4, 128, True, 7)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        for _ in range(3):
            got = kernels.aq_quantize(x, 1, 4, 128, True, 7)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert failing_kernels["average_quant.aq_quantize_triton"] == 1  # never tried again
    warnings = [r.getMessage() for r in caplog.records if "Triton kernel" in r.getMessage()]
    assert len(warnings) == 1
    assert "average_quant.aq_quantize_triton failed (RuntimeError: simulated" in warnings[0]
    assert "its PyTorch twin runs instead" in warnings[0]


def _bert():
    from hf_actq.testing import tiny_bert

    return tiny_bert(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)


# case: (model, config, the kernels its step runs besides the few-bit and norm ones); together
# they run every launcher.
CASES = {
    "llama-uniform": (
        lambda: tiny_llama(hidden_act="gelu"),
        ActQConfig.from_recipe("uniform"),
        {"average_quant.aq_quantize_triton", "average_quant.aq_dequantize_triton"},
    ),
    "llama-fewbit": (tiny_llama, ActQConfig.from_recipe("fewbit"), set()),
    "bert-blpa-masks": (
        _bert,
        ActQConfig(bits=4, codec="blpa", dropout_mode="mask"),
        {"sign_preserving.blpa_quantize_triton", "sign_preserving.blpa_dequantize_triton"}
        | {"mask.mask_pack_triton", "mask.mask_unpack_triton"},
    ),
    "bert-smaq-seeds": (
        _bert,
        ActQConfig(codec="smaq", bits=8),
        {"smaq.smaq_quantize_triton", "smaq.smaq_dequantize_triton"}
        | {"dropout.seeded_dropout_triton"},
    ),
}
ALWAYS = {"fewbit.fewbit_forward_triton", "fewbit.fewbit_backward_triton"}
ALWAYS |= {"norm.norm_backward_triton"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_goes_on_with_the_twins_when_every_kernel_fails(case, monkeypatch, caplog):
    make, config, kernels_run = CASES[case]
    model = make()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1]) if case.startswith("bert") else ids

    def step(m):
        torch.manual_seed(0)
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    twins = copy.deepcopy(model)
    handle = hf_actq.apply(twins, config)
    expected = step(twins)
    handle.revert()
    failing = _fail_every_kernel(monkeypatch)
    handle = hf_actq.apply(model, config)
    with caplog.at_level(logging.WARNING, logger="hf_actq"):
        got = step(model)
        step(model)  # the failed kernels are not tried again
    handle.revert()
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    tried = {name for name, count in failing.items() if count}
    assert tried == ALWAYS | kernels_run
    assert all(count == 1 for count in failing.values() if count)
    assert set(kernels.FAILED) == tried
    warned = [r for r in caplog.records if "Triton kernel" in r.getMessage()]
    assert len(warned) == len(tried)


def test_the_cases_run_every_launcher():
    import importlib

    defined = {
        f"{module}.{name}"
        for module in ("fewbit", "average_quant", "sign_preserving", "mask", "smaq", "dropout")
        + ("norm",)
        for name in vars(importlib.import_module(f"hf_actq.kernels.{module}"))
        if name.endswith("_triton")
    }
    assert defined == set(LAUNCHERS)
    assert set().union(ALWAYS, *(case[2] for case in CASES.values())) == set(LAUNCHERS)
