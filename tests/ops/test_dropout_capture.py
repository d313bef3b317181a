"""Eager CUDA-graph capture, simulated on the CPU (the GPU suite captures for real:
tests/test_cuda.py): a seed drawn on the host would be frozen into the graph, so dropout runs
stock there and a patched model's captured forward warns once about its rounding noise."""

import warnings

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig
from hf_actq.ops import attention, dedup, dropout
from hf_actq.ops.dropout import CompressedDropout
from hf_actq.testing import tiny_batch, tiny_model


@pytest.fixture
def capturing(monkeypatch):
    for module in (attention, dedup, dropout):
        monkeypatch.setattr(module, "capturing_cuda_graph", lambda device: True)
    monkeypatch.setattr(dedup, "_WARNED_EAGER_CAPTURE", [])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_captured_dropout_is_stock_dropout(capturing, requires_grad):
    x = torch.randn(4096, requires_grad=requires_grad)
    torch.manual_seed(3)
    stock = torch.nn.functional.dropout(x, 0.3, training=True)
    torch.manual_seed(3)
    assert torch.equal(CompressedDropout(0.3)(x), stock)


def test_a_captured_patched_forward_warns_once_about_frozen_rounding_noise(capturing):
    model = tiny_model("bert", dropout=True).train()
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    batch = tiny_batch("bert")
    with pytest.warns(UserWarning, match="captured into a CUDA graph in eager mode"):
        model(**batch).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch).loss.backward()  # once a process
