"""Eager CUDA-graph capture (``torch.cuda.graph``, ``make_graphed_callables``), simulated on
the CPU (the GPU suite captures for real: tests/test_cuda.py). A seed drawn on the host would be
frozen into the graph: packs whose kernels read their seed on the device draw it there, from the
device's generator, which each replay advances; the fused kernels that take host seeds stand
aside for stochastic codecs; dropout runs stock; the one codec left with a host seed warns."""

import warnings

import pytest
import torch

import hf_actq
from hf_actq import ActQConfig
from hf_actq.codecs import AverageQuantCodec, RotatedSampleCodec
from hf_actq.ops import attention, dedup, dropout, state
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import CompressedDropout
from hf_actq.testing import stubbed_kernels, tiny_batch, tiny_model


def _simulate_capture(monkeypatch, capturing: bool) -> None:
    for module in (attention, dedup, dropout, state):
        monkeypatch.setattr(module, "capturing_cuda_graph", lambda device: capturing)
    monkeypatch.setattr(dedup, "_WARNED_FROZEN_NOISE", [])


@pytest.fixture
def capturing(monkeypatch):
    _simulate_capture(monkeypatch, True)


@pytest.fixture
def seeds(monkeypatch):
    """Counts of the seeds drawn on the host and as device tensors."""
    drawn = {"host": 0, "device": 0}
    host, device = dedup.draw_seed, dedup.draw_seed_tensor

    def draw_host():
        drawn["host"] += 1
        return host()

    def draw_device(where):
        drawn["device"] += 1
        return device(where)

    monkeypatch.setattr(dedup, "draw_seed", draw_host)
    monkeypatch.setattr(dedup, "draw_seed_tensor", draw_device)
    return drawn


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_captured_dropout_is_stock_dropout(capturing, requires_grad):
    x = torch.randn(4096, requires_grad=requires_grad)
    torch.manual_seed(3)
    stock = torch.nn.functional.dropout(x, 0.3, training=True)
    torch.manual_seed(3)
    assert torch.equal(CompressedDropout(0.3)(x), stock)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_captured_pack_draws_its_seed_on_the_device(monkeypatch, seeds, captured):
    _simulate_capture(monkeypatch, captured)
    x = torch.randn(64, 32)
    codec = AverageQuantCodec(bits=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = PackCache().pack(x, codec, "layer:input")
    assert seeds == ({"host": 0, "device": 1} if captured else {"host": 1, "device": 0})
    torch.testing.assert_close(packed.unpack(), x, atol=(x.max() - x.min()).item() / 15, rtol=0)


def test_a_captured_pack_seeded_on_the_host_warns_once(capturing, seeds):
    sampled = RotatedSampleCodec(bits=4, group_size=2)  # its signs come from a host seed
    assert not sampled.takes_device_seed
    x = torch.randn(4, 256)
    with pytest.warns(UserWarning, match="noise drawn at capture"):
        PackCache().pack(x, sampled, "layer:input")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PackCache().pack(x, sampled, "other:input")  # once a process
    assert seeds == {"host": 2, "device": 0}


@pytest.mark.needs_kernels  # the kernels' dispatch: Triton installed
@pytest.mark.parametrize("recipe", ["uniform", "checkpoint"])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_captured_patched_step_draws_no_seed_on_the_host(monkeypatch, captured, recipe):
    """A patched BERT's step with dropout, through the kernels' dispatch (stubbed): captured,
    nothing draws a seed on the host (the packs draw theirs on the device, one per pack call
    as the host draws them, and dropout is stock), and the norms pack through the codec's
    kernel instead of the fused one; no warning."""
    model = tiny_model("bert", dropout=True).train()
    hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    batch = tiny_batch("bert")
    with stubbed_kernels() as (launches, host_seeds):
        _simulate_capture(monkeypatch, captured)
        drawn = []
        device_seed = dedup.draw_seed_tensor
        monkeypatch.setattr(dedup, "draw_seed_tensor", lambda d: drawn.append(d) or device_seed(d))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**batch).loss.backward()
    packs = launches["aq_quantize_kernel"] + launches["rotated_quantize_kernel"]
    fused = launches["norm_pack_kernel"]
    if captured:
        assert host_seeds == [0] and fused == 0, (host_seeds, launches)
        assert len(drawn) >= packs > 0, (len(drawn), launches)
    else:
        assert host_seeds[0] > 0 and not drawn, (host_seeds, drawn)
        assert fused > 0 or recipe == "checkpoint", launches  # its layers keep only inputs
