import math

import pytest
import torch

from hf_actq.codecs import SmaQCodec, pack, unpack
from hf_actq.codecs.packed import draw_seed


def _clipped(x):
    mean, std = x.double().mean(), x.double().std(correction=0)
    return (x.double().clamp(mean - 2 * std, mean + 2 * std)), mean.item(), std.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", [64, 128, 256])
def test_sizes_and_errors(block, dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 101) * 3 + 1).to(dtype)
    codec = SmaQCodec(block_size=block)
    packed = pack(x, codec)
    n = x.numel()
    assert packed.nbytes == codec.nbytes(x.shape)
    assert packed.nbytes == math.ceil(6 * n / 8) + math.ceil(n / block) * codec.slots // 4 + 8
    assert 8 * packed.nbytes / n < 6.85
    y = unpack(packed)
    assert y.shape == x.shape and y.dtype == dtype
    target, mean, std = _clipped(x.float())
    err = (y.double() - target).abs()
    z = ((x.double() - mean) / std).abs()
    inlier = z <= 1
    slack = 3 * torch.finfo(dtype).eps * (abs(mean) + 2 * std)
    # One code step: 2/31 sigma for inliers, 1/63 (1/15 when a block overflows) for outliers.
    assert err[inlier].max() <= 2 / 31 * std + slack
    assert err[~inlier].max() <= std / 15 + slack


def test_unbiased_and_seeded():
    torch.manual_seed(0)
    x = torch.randn(512)
    target, _, std = _clipped(x)
    codec = SmaQCodec(block_size=64)
    trials = 600
    total = torch.zeros(512, dtype=torch.float64)
    for _ in range(trials):
        total += unpack(pack(x, codec)).double()
    assert (total / trials - target).abs().max() < 5 * (2 / 31 * std) / math.sqrt(trials)
    seed = draw_seed()
    assert torch.equal(codec.pack(x, seed).tensors[0], codec.pack(x, seed).tensors[0])


def test_crowded_blocks_fall_back_to_four_bit_magnitudes():
    # Half the values far out: more outliers than a block has extension slots.
    x = torch.cat([torch.full((64,), 1.5), torch.full((64,), -1.5), torch.zeros(128)])
    x = x + 1e-3 * torch.randn(256)
    for capacity in (0.0, 0.375, 1.0):
        codec = SmaQCodec(block_size=64, capacity=capacity)
        y = unpack(pack(x, codec))
        target, _, std = _clipped(x)
        assert (y.double() - target).abs().max() <= std / 15 + 1e-6
    assert SmaQCodec(block_size=64, capacity=0.0).slots == 0
    assert SmaQCodec(block_size=64, capacity=1.0).slots == 64


def test_constant_and_empty_tensors():
    y = unpack(pack(torch.full((100,), 3.0), SmaQCodec()))
    assert torch.allclose(y, torch.full((100,), 3.0))
    empty = pack(torch.randn(0, 5), SmaQCodec())
    assert empty.nbytes == SmaQCodec().nbytes((0, 5)) == 8
    assert unpack(empty).shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 32}, "block_size must be one of"),
        ({"capacity": 1.5}, "capacity must be a fraction"),
    ],
)
def test_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SmaQCodec(**kwargs)
