"""The TorchInductor-compiled twins (kernels/compiled.py) against the same twins run eagerly:
equal bit for bit, whatever the chunking; and the eager fallback when compiling fails."""

import os

import pytest
import torch

if os.environ.get("HF_ACTQ_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("the compiled twins are the CPU path", allow_module_level=True)

from hf_actq.fewbit import table_for
from hf_actq.kernels import average_quant, compiled
from hf_actq.kernels.average_quant import aq_dequantize_reference, aq_quantize_reference
from hf_actq.kernels.fewbit import fewbit_backward_reference, fewbit_forward_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _by_dtype(cases: list[tuple], half: tuple) -> list:
    """Every case in fp32, and ``half`` in bf16 and fp16; the other half-precision cases run
    with -m slow (each is one more inductor compile, slow with the cold cache CI starts with)."""
    return [
        pytest.param(
            dtype,
            *case,
            marks=[pytest.mark.slow] if dtype != torch.float32 and case != half else [],
            id="-".join(str(v) for v in (*case, dtype)),
        )
        for dtype in DTYPES
        for case in cases
    ]


@pytest.fixture
def eager_and_compiled(monkeypatch):
    """Run ``fn`` eagerly with many small chunks, then compiled with one: equal outputs mean the
    compiled path matches and neither chunking moves a code or a noise draw."""

    def both(fn):
        monkeypatch.setattr(compiled, "MIN_ELEMENTS", 1 << 60)
        monkeypatch.setattr(average_quant, "CODEC_CHUNK", 256)
        eager = fn()
        monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
        got = fn()
        assert not compiled._broken, compiled._broken
        return eager, got

    return both


@pytest.mark.parametrize(
    "dtype,bits,group,block,stochastic",
    _by_dtype(
        [
            (1, 1, 32, True),
            (3, 1, 128, True),
            (2, 4, 64, True),
            (4, 1, 128, False),
            (8, 2, 32, True),
        ],
        half=(2, 4, 64, True),
    ),
)
def test_aq_compiled_equals_eager(eager_and_compiled, dtype, bits, group, block, stochastic):
    n_means = 3000 + bits  # not a multiple of the block or of 8
    source = (
        torch.randn(
            n_means * group, generator=torch.Generator(torch.get_default_device()).manual_seed(bits)
        )
        * 3
    ).to(dtype)
    eager, got = eager_and_compiled(
        lambda: aq_quantize_reference(source, group, bits, block, stochastic, seed=11)
    )
    for expected, actual in zip(eager, got):
        assert torch.equal(expected, actual)
    shape = torch.Size([n_means, group])
    eager, got = eager_and_compiled(
        lambda: aq_dequantize_reference(*eager, shape, dtype, bits, group, block)
    )
    assert torch.equal(eager, got)


@pytest.mark.parametrize(
    "dtype,activation,bits",
    _by_dtype([("gelu", 3), ("silu", 4), ("gelu", 1), ("relu", 1)], half=("gelu", 3)),
)
def test_fewbit_codes_compiled_equal_eager(eager_and_compiled, dtype, activation, bits):
    x = (
        torch.randn(5003, generator=torch.Generator(torch.get_default_device()).manual_seed(bits))
        * 4
    ).to(dtype)
    x[7] = float("nan")
    x[8:12] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")]).to(dtype)
    borders = torch.tensor(table_for(activation, bits).borders, dtype=torch.float32)
    eager, got = eager_and_compiled(lambda: fewbit_forward_reference(x, activation, borders, bits))
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(eager[1], got[1]) and torch.equal(eager[2], got[2])
    assert got[2].item() == 1  # the NaN is seen


@pytest.mark.parametrize(
    "dtype,activation,bits",
    _by_dtype([("gelu", 3), ("silu", 4), ("gelu", 2), ("relu", 1)], half=("gelu", 3)),
)
@pytest.mark.parametrize("nan_seen", [False, True])
def test_fewbit_backward_compiled_equals_eager(
    eager_and_compiled, dtype, activation, bits, nan_seen
):
    generator = torch.Generator(torch.get_default_device()).manual_seed(bits)
    x = (torch.randn(5000, generator=generator) * 4).to(dtype)  # whole groups of eight: compiled
    grad_y = torch.randn(5000, generator=generator).to(dtype)
    grad_y[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]).to(dtype)
    table = table_for(activation, bits)
    borders = torch.tensor(table.borders, dtype=torch.float32)
    _, packed, _ = fewbit_forward_reference(x, activation, borders, bits, output=False)
    levels = torch.tensor(table.levels, dtype=torch.float32)
    nan_flag = torch.tensor([int(nan_seen)], dtype=torch.int32)
    eager, got = eager_and_compiled(
        lambda: fewbit_backward_reference(grad_y, packed, levels, nan_flag, bits)
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got, eager, rtol=0, atol=0, equal_nan=True)
    # A NaN seen in the forward makes every gradient NaN: the codes cannot say where it was.
    assert got.isnan().all() == nan_seen


def test_uniform_noise_is_uniform_and_chunk_free():
    index = torch.arange(1 << 20, dtype=torch.int32)
    key = torch.tensor(compiled.mix_seed(3), dtype=torch.int32)
    u = compiled.uniform_noise(index, key)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 2e-3
    histogram = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (histogram - 1 / 16).abs().max() < 2e-3
    # Neighbours and another seed's stream are uncorrelated.
    other = compiled.uniform_noise(index, torch.tensor(compiled.mix_seed(4), dtype=torch.int32))
    for a, b in ((u[1:], u[:-1]), (u, other)):
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5e-3
    # A slice of the counters gives the same noise as the whole.
    assert torch.equal(compiled.uniform_noise(index[1000:2000], key), u[1000:2000])


def test_failed_compilation_falls_back_to_eager_and_warns_once(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "_broken", [])
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch, "compile", broken)
    compiled._compiled.cache_clear()
    source = torch.randn(4096)
    with pytest.warns(UserWarning, match="compiling the CPU kernels failed .*no C\\+\\+ compiler"):
        got = aq_quantize_reference(source, 1, 3, 128, True, seed=5)
    assert compiled._broken and not compiled.use_compiled(source)
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 1 << 60)
    expected = aq_quantize_reference(source, 1, 3, 128, True, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    compiled._compiled.cache_clear()


def test_switch_and_size_threshold(monkeypatch):
    big = torch.empty(compiled.MIN_ELEMENTS)
    assert compiled.use_compiled(big)
    assert not compiled.use_compiled(big[:-1])
    monkeypatch.setenv("HF_ACTQ_COMPILED_TWINS", "0")
    assert not compiled.use_compiled(big)
