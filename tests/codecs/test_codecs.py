import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_actq.codecs import (
    AverageQuantCodec,
    MaskCodec,
    SignPreservingCodec,
    make_codec,
    pack,
    uniform,
    unpack,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _group_means(x, g):
    last = x.shape[-1]
    rows = x.float().reshape(-1, last)
    pad = (-last) % g
    padded = torch.nn.functional.pad(rows, (0, pad))
    sums = padded.view(rows.shape[0], -1, g).sum(-1)
    counts = torch.full((sums.shape[1],), float(g))
    if pad:
        counts[-1] = g - pad
    return (sums / counts).repeat_interleave(g, dim=1)[:, :last].reshape(x.shape)


def _block_scale(codec, x):
    """Largest quantization step of any block (an upper bound on one code's width)."""
    means = _group_means(x, codec.group_size)
    last = x.shape[-1]
    per_row = means.reshape(-1, last)[:, :: codec.group_size].reshape(-1)
    pad = (-per_row.numel()) % codec.block_size
    blocks = torch.cat([per_row, per_row[-1:].expand(pad)]).view(-1, codec.block_size)
    return ((blocks.amax(1) - blocks.amin(1)) / (2**codec.bits - 1)).max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "codec",
    [
        uniform(1),
        uniform(3),
        uniform(4),
        uniform(8),
        AverageQuantCodec(2, 4),
        AverageQuantCodec(1, 2),
        AverageQuantCodec(4, 16, block_size=32),
        AverageQuantCodec(2, 8),
    ],
    ids=repr,
)
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 100), (1000,), (4, 13)])
def test_average_quant_sizes_and_error(codec, shape, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    packed = pack(x, codec)
    means = math.prod(shape[:-1]) * -(-shape[-1] // codec.group_size)
    blocks = -(-means // codec.block_size)
    expected = math.ceil(means * codec.bits / 8) + blocks * 8
    assert packed.nbytes == expected == codec.nbytes(shape)
    assert [t.dtype for t in packed.tensors] == [torch.uint8, torch.float32, torch.float32]
    y = unpack(packed)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - _group_means(x, codec.group_size)).abs().max().item()
    half_ulp = torch.finfo(dtype).eps * x.float().abs().max().item()
    assert err <= _block_scale(codec, x) * (1 + 1e-5) + 2 * half_ulp


@pytest.mark.parametrize("codec", [uniform(2), AverageQuantCodec(2, 4), uniform(1)], ids=repr)
def test_stochastic_rounding_is_unbiased(codec):
    torch.manual_seed(1)
    x = torch.randn(8, 64)
    target = _group_means(x, codec.group_size)
    trials = 4000
    total = torch.zeros_like(x)
    for _ in range(trials):
        total += unpack(pack(x, codec))
    mean = total / trials
    # Each trial's error is at most one step; the mean of independent trials shrinks ~1/sqrt(n).
    tolerance = 5 * _block_scale(codec, x) / math.sqrt(trials)
    assert (mean - target).abs().max().item() < tolerance
    # ... while a single pack is far noisier than that.
    assert (unpack(pack(x, codec)) - target).abs().max().item() > tolerance


def test_deterministic_rounding_halves_the_error():
    x = torch.randn(16, 128)
    codec = uniform(3, stochastic=False)
    err = (unpack(pack(x, codec)) - x).abs().max().item()
    assert err <= _block_scale(codec, x) / 2 * (1 + 1e-5)
    assert torch.equal(pack(x, codec).tensors[0], pack(x, codec).tensors[0])


def test_seed_reproduces_codes_and_rng_state_advances():
    x = torch.randn(4, 256)
    torch.manual_seed(7)
    first = pack(x, uniform(2)).tensors[0]
    second = pack(x, uniform(2)).tensors[0]
    torch.manual_seed(7)
    assert torch.equal(pack(x, uniform(2)).tensors[0], first)
    assert not torch.equal(first, second)


def test_constant_blocks_and_extremes():
    x = torch.zeros(3, 128)
    x[1] = 5.0
    y = unpack(pack(x, uniform(2)))
    assert torch.equal(y, x)
    big = torch.tensor([[-1.5e38, 1.5e38, 0.0, 1.0]])  # a range up to the fp32 maximum
    assert torch.isfinite(unpack(pack(big, uniform(8)))).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_sign_preserving_keeps_the_sign(bits, dtype):
    torch.manual_seed(0)
    x = (torch.randn(50, 77) * 2).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 0.0], dtype=dtype)
    codec = SignPreservingCodec(bits)
    packed = pack(x, codec)
    n = x.numel()
    assert packed.nbytes == math.ceil(n * bits / 8) + -(-n // 128) * 4 == codec.nbytes(x.shape)
    y = unpack(packed)
    assert torch.equal(y > 0, x > 0)
    step = x.float().abs().max().item() / 2 ** (bits - 1)
    assert (y.float() - x.float()).abs().max().item() <= step * (1 + 1e-3)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16, torch.uint8])
def test_mask_round_trip_is_one_bit_per_element(dtype):
    torch.manual_seed(0)
    mask = torch.rand(17, 33) > 0.3
    x = mask.to(dtype)
    packed = pack(x, MaskCodec())
    assert packed.nbytes == math.ceil(17 * 33 / 8)
    y = unpack(packed)
    assert y.dtype == dtype and torch.equal(y, x)


def test_dropout_style_scaled_mask():
    x = (torch.rand(100) > 0.1).float() / 0.9
    y = unpack(pack(x, "mask"))
    assert torch.equal(y / 0.9, x)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4)])
def test_empty_tensors(shape):
    for codec in (uniform(4), AverageQuantCodec(2, 4), SignPreservingCodec(4), MaskCodec()):
        x = torch.randn(shape)
        packed = pack(x, codec)
        assert packed.nbytes == codec.nbytes(shape) == 0
        assert unpack(packed).shape == shape


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    bits=st.integers(1, 8),
    group=st.sampled_from([1, 2, 4, 8, 16]),
    transpose=st.booleans(),
)
def test_property_shapes_strides_dtypes(shape, dtype, bits, group, transpose):
    x = torch.randn(shape).to(dtype)
    if transpose and x.dim() > 1:
        x = x.transpose(0, -1)
    codec = AverageQuantCodec(bits, group, block_size=32)
    packed = pack(x, codec)
    assert packed.nbytes == codec.nbytes(x.shape)
    y = unpack(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    lo, hi = x.float().min().item(), x.float().max().item()
    slack = 1e-2 * max(1.0, abs(lo), abs(hi))
    assert lo - slack <= y.float().min().item() and y.float().max().item() <= hi + slack


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: uniform(9), "bits must be an integer in 1..8, got 9"),
        (lambda: uniform(0), "bits must be an integer in 1..8, got 0"),
        (lambda: AverageQuantCodec(2, 3), "group_size must be one of 1, 2, 4, 8, 16, got 3"),
        (
            lambda: AverageQuantCodec(2, 4, block_size=100),
            "block_size must be one of 32, 64, 128, 256, got 100",
        ),
        (
            lambda: make_codec("zstd"),
            "unknown codec 'zstd'; allowed values: aq, blpa, mask, rotated, smaq",
        ),
        (lambda: pack(torch.arange(4), "uniform"), "packs floating-point tensors"),
        (lambda: pack(torch.randn(4), uniform(2), bits=3), "either in the codec object"),
    ],
)
def test_invalid_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_each_rank_draws_its_own_seeds_and_rank_zero_draws_torchs(monkeypatch):
    from hf_actq.codecs.packed import draw_seed

    seeds = {}
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))  # what launchers set before the group exists
        torch.manual_seed(0)
        seeds[rank] = [draw_seed() for _ in range(3)]
    assert len({tuple(s) for s in seeds.values()}) == 4
    torch.manual_seed(0)
    assert seeds[0] == [int(torch.randint(0, 2**31 - 1, (1,), device="cpu")) for _ in range(3)]
    assert all(0 <= seed < 2**31 - 1 for s in seeds.values() for seed in s)
