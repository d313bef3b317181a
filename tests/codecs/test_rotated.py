import pytest
import torch

from hf_actq import ActQConfig
from hf_actq.codecs import AverageQuantCodec, RotatedSampleCodec, make_codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _outlier_features(rows=64, features=256, seed=0):
    """Activations with a few large features, as a pretrained transformer's are."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    x[:, 7] *= 30
    x[:, 100] *= 12
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 100), (1000,), (4, 256), (0,)])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_sizes_dtypes_and_the_bits_it_keeps(shape, dtype, group):
    codec = RotatedSampleCodec(bits=2, group_size=group)
    x = torch.randn(shape).to(dtype)
    packed = codec.pack(x)
    assert packed.nbytes == codec.nbytes(shape)  # known before packing, seed included
    out = packed.unpack()
    assert out.shape == x.shape and out.dtype == dtype
    if shape == (4, 256):  # whole rotations: 2 / group bits per value plus the block metadata
        assert packed.nbytes * 8 / x.numel() <= 2 / group + 0.5 + 64 / x.numel()


def test_every_coefficient_kept_rounds_finer_than_uniform_at_its_bytes():
    """Group 1 (rotated uniform rounding): unbiased, uniform stochastic rounding's bytes, and
    several times less error where a few features are large, since the rotation spreads them
    over the block that would otherwise round at their scale."""
    x = _outlier_features()
    rotated, plain = RotatedSampleCodec(bits=4, group_size=1), AverageQuantCodec(bits=4)
    assert rotated.nbytes(x.shape) == plain.nbytes(x.shape)
    assert RotatedSampleCodec(bits=4, group_size=1, stochastic=False).uses_rng is False
    energy = x.pow(2).sum()

    def error(codec, seed):
        return float((codec.pack(x, seed).unpack() - x).pow(2).sum() / energy)

    rotated_error = sum(error(rotated, s) for s in range(8)) / 8
    plain_error = sum(error(plain, s) for s in range(8)) / 8
    assert rotated_error < plain_error / 3
    draws = torch.stack([rotated.pack(x, seed).unpack() for seed in range(200)])
    assert (draws.mean(0) - x).pow(2).sum() / energy < 2 * rotated_error / 200


@pytest.mark.parametrize("group", [2, 4, 8])
def test_unbiased_with_the_variance_it_should_have(group):
    """E[x_hat] = x, and one draw's squared error is (g - 1) ||x||^2 plus the rounding's."""
    codec = RotatedSampleCodec(bits=8, group_size=group)  # 8 bits: rounding error negligible
    x = _outlier_features()
    draws = torch.stack([codec.pack(x, seed).unpack() for seed in range(200)])
    energy = x.pow(2).sum()
    single = ((draws - x).pow(2).sum(dim=(1, 2)) / energy).mean().item()
    assert single == pytest.approx(group - 1, rel=0.1)
    mean_error = (draws.mean(0) - x).pow(2).sum() / energy
    assert mean_error < 2 * single / 200  # the error of the mean falls as 1/draws


def test_a_linear_layers_weight_gradient_stays_unbiased_where_averaging_projects_it(monkeypatch):
    """AQ's group means make dY^T X a projection of the weight gradient (cosine about
    sqrt(1/g) whatever the seeds); rotated sampling at the same bytes averages out."""
    # The eager twins: the compiled ones give the same bits (tests/kernels/test_compiled.py),
    # after a compile that took 14 s of this test's 25 on a cold cache.
    monkeypatch.setenv("HF_ACTQ_COMPILED_TWINS", "0")
    x = _outlier_features(rows=256)
    dy = torch.randn(256, 32, generator=torch.Generator(torch.get_default_device()).manual_seed(1))
    exact = dy.T @ x

    def mean_gradient(codec, draws=64):
        return torch.stack([dy.T @ codec.pack(x, s).unpack().float() for s in range(draws)]).mean(0)

    def cosine(a, b):
        return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()

    averaged = mean_gradient(AverageQuantCodec(bits=2, group_size=4))
    rotated = mean_gradient(RotatedSampleCodec(bits=2, group_size=4))
    assert cosine(averaged, exact) < 0.8
    assert cosine(rotated, exact) > 0.95


def test_seed_reproduces_and_a_new_seed_draws_new_signs():
    codec = RotatedSampleCodec()
    x = torch.randn(10, 128)
    assert torch.equal(codec.pack(x, 5).unpack(), codec.pack(x, 5).unpack())
    assert not torch.equal(codec.pack(x, 5).unpack(), codec.pack(x, 6).unpack())
    state = torch.get_rng_state()
    codec.pack(x)  # no seed: one drawn from torch's generator
    assert not torch.equal(torch.get_rng_state(), state)


def test_per_slot_settings_give_it_and_the_global_codec_refuses_it():
    config = ActQConfig(slots={"re::input$": {"codec": "rotated", "bits": 0.5}})
    codec = config.codec_for_setting(config.setting_for("a.b:input"))
    assert codec == RotatedSampleCodec(bits=2, group_size=4)
    assert make_codec("rotated", group_size=8) == RotatedSampleCodec(bits=2, group_size=8)
    four = ActQConfig(slots={"a:input": {"codec": "rotated", "bits": 4}})
    assert four.codec_for_setting(four.setting_for("a:input")) == RotatedSampleCodec(4, 1)
    for bits in (2.5, 9, 0.01, True):
        with pytest.raises(ValueError, match="'rotated' setting's bits must be a number in 1/16"):
            ActQConfig(slots={"a:input": {"codec": "rotated", "bits": bits}})
    # As the global codec: every coefficient kept, from 2 bits up (sampling is per slot only).
    assert ActQConfig(codec="rotated", bits=3).make_codec() == RotatedSampleCodec(3, 1)
    with pytest.raises(ValueError, match="an integer in 2..8 for codec 'rotated'"):
        ActQConfig(codec="rotated", bits=1)
    with pytest.raises(ValueError, match="group_size"):
        RotatedSampleCodec(group_size=3)
