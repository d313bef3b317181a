"""Codec kernels under the Triton interpreter against their PyTorch twins."""

import math
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_ACTQ_TEST_DEVICE") != "cuda":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported, or HF_ACTQ_TEST_DEVICE=cuda",
        allow_module_level=True,
    )

from hf_actq.codecs.packed import BLOCK_SIZES, draw_seed  # noqa: E402
from hf_actq.kernels.average_quant import (  # noqa: E402
    aq_dequantize_reference,
    aq_dequantize_triton,
    aq_quantize_reference,
    aq_quantize_triton,
)
from hf_actq.kernels.mask import (  # noqa: E402
    mask_pack_reference,
    mask_pack_triton,
    mask_unpack_reference,
    mask_unpack_triton,
)
from hf_actq.kernels.packing import unpack_codes  # noqa: E402
from hf_actq.kernels.sign_preserving import (  # noqa: E402
    blpa_dequantize_reference,
    blpa_dequantize_triton,
    blpa_quantize_reference,
    blpa_quantize_triton,
)
from hf_actq.kernels.smaq import (  # noqa: E402
    smaq_codes_reference,
    smaq_dequantize_reference,
    smaq_dequantize_triton,
    smaq_quantize_reference,
    smaq_quantize_triton,
    smaq_stats_reference,
    smaq_stats_triton,
    strided_tiles,
)
from hf_actq.kernels.triton_common import strided_rows  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "bits,group,block", [(1, 1, 32), (3, 1, 64), (4, 2, 128), (2, 4, 256), (8, 16, 32), (5, 8, 64)]
)
def test_aq_deterministic_kernel_matches_twin(bits, group, block, dtype):
    torch.manual_seed(bits * 7 + group)
    n_means = 1000 + bits  # not a multiple of the block or of 8
    source = (torch.randn(n_means * group) * 3).to(dtype)
    got = aq_quantize_triton(source, group, bits, block, stochastic=False)
    expected = aq_quantize_reference(source, group, bits, block, stochastic=False)
    # Group means are fp32 sums in a different order: equal up to the last bit.
    tolerance = 0 if group == 1 else 1e-6
    torch.testing.assert_close(got[1], expected[1], rtol=tolerance, atol=0)
    torch.testing.assert_close(got[2], expected[2], rtol=max(tolerance, 1e-6), atol=0)
    codes_got = unpack_codes(got[0], n_means, bits).int()
    codes_expected = unpack_codes(expected[0], n_means, bits).int()
    if group == 1:
        assert torch.equal(codes_got, codes_expected)
    else:
        # fp32 group sums may round differently in the last bit; a code then moves by one.
        assert (codes_got - codes_expected).abs().max() <= 1
        assert (codes_got != codes_expected).float().mean() < 0.01
    shape = torch.Size([n_means, group])
    out = aq_dequantize_triton(*expected, shape, dtype, bits, group, block)
    assert torch.equal(out, aq_dequantize_reference(*expected, shape, dtype, bits, group, block))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_aq_stochastic_kernel_packs_the_twins_codes_bit_for_bit(bits):
    """The kernel draws the twin's hashed noise: the same seed gives the same codes, over
    several tiles and a partial last block and byte."""
    torch.manual_seed(bits)
    source = (torch.randn(9001) * 2).to(torch.bfloat16)
    got = aq_quantize_triton(source, 1, bits, 64, True, 987654)
    expected = aq_quantize_reference(source, 1, bits, 64, True, 987654)
    for got_buffer, expected_buffer in zip(got, expected):
        assert torch.equal(got_buffer, expected_buffer)


@pytest.mark.parametrize("seed", [0, 987654, 2**31 - 2])
def test_aq_kernel_reads_a_seed_on_the_device_as_the_host_seed(seed):
    """A compiled step passes its seed as a tensor on the device (read there, a CUDA graph
    replays it fresh): the kernel mixes it in-kernel into the key the host's ``mix_seed``
    gives, so the codes are the twin's for that seed as an int."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed % 97)
    source = (torch.randn(9001, generator=generator) * 2).to(torch.bfloat16)
    device_seed = torch.tensor([seed], dtype=torch.int64)
    got = aq_quantize_triton(source, 2, 3, 64, True, 0, device_seed)
    expected = aq_quantize_reference(source, 2, 3, 64, True, seed)
    twin = aq_quantize_reference(source, 2, 3, 64, True, 0, device_seed)
    for got_buffer, expected_buffer, twin_buffer in zip(got, expected, twin):
        assert torch.equal(got_buffer, expected_buffer) and torch.equal(
            twin_buffer, expected_buffer
        )
    other = aq_quantize_triton(source, 2, 3, 64, True, 0, device_seed + 1)
    assert not torch.equal(other[0], got[0])


def _strided(physical, permutation=(0, 2, 1, 3)):
    torch.manual_seed(sum(physical))
    return (torch.randn(physical) * 3).to(torch.bfloat16).permute(permutation)


# (view, bits, group, block): attention's q, k and v are [batch, seq, heads, dim] tensors seen
# as [batch, heads, seq, dim]; a program takes 4,096 values of one head's rows, so each head
# ends in a partial tile here (the next head's codes must survive it).
STRIDED_VIEWS = {
    "head dim 32": (lambda: _strided((2, 200, 3, 32)), 4, 1, 128),
    "head dim 128": (lambda: _strided((2, 48, 4, 128)), 3, 1, 64),
    "groups of 4": (lambda: _strided((3, 70, 2, 64)), 2, 4, 32),
    "a block of 4096": (lambda: _strided((1, 512, 2, 16)), 8, 16, 256),
    "columns of a wider tensor": (lambda: _strided((5, 40, 96), (0, 1, 2))[:, :, :64], 4, 1, 128),
}


@pytest.mark.parametrize(
    "name,stochastic",
    # Every view rounded to nearest; stochastic rounding (the same loads, noise added) on two.
    [(name, False) for name in STRIDED_VIEWS] + [("head dim 128", True), ("groups of 4", True)],
)
def test_aq_kernel_packs_a_transposed_view_where_it_lies_as_its_flat_copy(name, stochastic):

    make, bits, group, block = STRIDED_VIEWS[name]
    view = make()
    assert not view.is_contiguous() and strided_rows(view, group, block) is not None
    got = aq_quantize_triton(view, group, bits, block, stochastic, 2024)
    expected = aq_quantize_reference(view.reshape(-1), group, bits, block, stochastic, 2024)
    # Means of groups are sums in the same order here: bit for bit at every group size.
    for got_buffer, expected_buffer in zip(got, expected):
        assert torch.equal(got_buffer, expected_buffer)


@pytest.mark.parametrize("name", list(STRIDED_VIEWS))
def test_blpa_kernel_packs_a_transposed_view_where_it_lies_as_its_flat_copy(name):
    make, bits, _, block = STRIDED_VIEWS[name]
    view = make()
    assert strided_rows(view, 1, block) is not None
    got = blpa_quantize_triton(view, bits, block)
    expected = blpa_quantize_reference(view.reshape(-1), bits, block)
    for got_buffer, expected_buffer in zip(got, expected, strict=True):
        assert torch.equal(got_buffer, expected_buffer)
    assert torch.equal(blpa_quantize_triton(view.contiguous(), bits, block)[0], got[0])


@pytest.mark.parametrize(
    "view",
    [
        _strided((2, 10, 3, 48)),  # a head dim that is not a power of two
        _strided((1, 3, 2, 32)),  # a head's rows end inside a block
        _strided((2, 10, 3, 4)),  # rows narrower than a 128-bit load
    ],
    ids=["dim 48", "rows inside a block", "dim 4"],
)
def test_aq_kernel_copies_other_strided_views_first(view):

    assert strided_rows(view, 1, 128) is None
    got = aq_quantize_triton(view, 1, 4, 128, True, 5)
    for got_buffer, expected_buffer in zip(got, aq_quantize_reference(view, 1, 4, 128, True, 5)):
        assert torch.equal(got_buffer, expected_buffer)


def _with_non_finite(source: torch.Tensor) -> torch.Tensor:
    """``source`` (flat order) with a NaN, an infinity of each sign, and both in one block."""
    flat = source.reshape(-1)
    for index, value in ((10, "nan"), (300, "inf"), (700, "-inf"), (1000, "inf"), (1001, "-inf")):
        flat[index] = float(value)
    return source


def _assert_same_buffers_and_values(got, expected, unpack, codes=True):
    for got_buffer, expected_buffer in zip(got, expected, strict=True):
        if codes or got_buffer.is_floating_point():
            torch.testing.assert_close(got_buffer, expected_buffer, rtol=0, atol=0, equal_nan=True)
    values, twin_values = unpack(got, kernel=True), unpack(expected, kernel=False)
    torch.testing.assert_close(values, twin_values, rtol=0, atol=0, equal_nan=True)
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "codec", ["aq nearest", "aq stochastic", "aq groups of 4", "aq strided", "blpa", "smaq"]
)
def test_codec_kernels_keep_nan_and_infinities_non_finite_as_their_twins(codec, dtype):
    """A non-finite value makes its block's values non-finite in backward, in the kernel as in
    the twin (the stock model's saved tensor holds it): a GPU's min/max reductions drop NaN,
    and the block's other values would then round to finite codes."""
    torch.manual_seed(1)
    n = 3000
    if codec == "smaq":
        source = _with_non_finite((torch.randn(n) * 2).to(dtype))
        stats = smaq_stats_reference(source)
        torch.testing.assert_close(smaq_stats_triton(source), stats, equal_nan=True)
        quantize = (smaq_quantize_triton, smaq_quantize_reference)
        got, expected = (f(source, 64, 24, True, 77) for f in quantize)
        dequantize = (smaq_dequantize_triton, smaq_dequantize_reference)
        args = (source.shape, dtype, 64, 24)
        # NaN statistics make every value NaN; the codes, of NaN, are anything.
        values = _assert_same_buffers_and_values(
            got,
            expected,
            lambda buffers, kernel: dequantize[not kernel](*buffers, *args),
            codes=False,
        )
        assert values.isnan().all()
        return
    group, block = (4, 32) if codec == "aq groups of 4" else (1, 128)
    if codec == "aq strided":
        source = _with_non_finite(torch.randn(2, 200, 3, 32).to(dtype)).permute(0, 2, 1, 3)
        blocks = source.reshape(-1).view(-1, block)
    else:
        source = _with_non_finite((torch.randn(n) * 2).to(dtype))
        blocks = source[: n // (block * group) * block * group].view(-1, block * group)
    if codec == "blpa":
        got = blpa_quantize_triton(source, 4, block)
        expected = blpa_quantize_reference(source, 4, block)
        dequantize = (blpa_dequantize_triton, blpa_dequantize_reference)
        args = (source.shape, dtype, 4, block)
    else:
        stochastic = codec == "aq stochastic"
        got = aq_quantize_triton(source, group, 4, block, stochastic, 9)
        expected = aq_quantize_reference(source.reshape(-1), group, 4, block, stochastic, 9)
        dequantize = (aq_dequantize_triton, aq_dequantize_reference)
        args = (torch.Size([source.numel() // group, group]), dtype, 4, group, block)
    values = _assert_same_buffers_and_values(
        got, expected, lambda buffers, kernel: dequantize[not kernel](*buffers, *args)
    )
    values = values.reshape(-1)[: blocks.numel()].view(blocks.shape)
    non_finite_blocks = ~blocks.isfinite().all(dim=1)
    assert non_finite_blocks.sum() >= 3  # the NaN's, the infinities' (flat: 4 blocks)
    assert torch.equal(~values.isfinite().all(dim=1), non_finite_blocks)


def test_aq_quantize_keeps_codes_and_metadata_in_one_allocation():
    mins_storage = aq_quantize_triton(torch.randn(1000), 1, 4, 128, False)
    pointers = {t.untyped_storage().data_ptr() for t in mins_storage}
    assert len(pointers) == 1
    assert mins_storage[0].untyped_storage().nbytes() == 8 * 8 + 500  # 8 blocks, then codes
    assert all(t.numel() == 0 for t in aq_quantize_triton(torch.empty(0), 1, 4, 128, True, 3))
    assert all(t.numel() == 0 for t in blpa_quantize_triton(torch.empty(0), 4, 128))


def test_aq_dequantize_partial_groups_and_shapes():
    shape = torch.Size([5, 7, 10])  # last dim not a multiple of the group
    means = 5 * 7 * 3
    source = torch.randn(means)
    packed = aq_quantize_reference(source, 1, 3, 32, stochastic=False)
    got = aq_dequantize_triton(*packed, shape, torch.bfloat16, 3, 4, 32)
    expected = aq_dequantize_reference(*packed, shape, torch.bfloat16, 3, 4, 32)
    assert torch.equal(got, expected)


def test_aq_stochastic_kernel_is_unbiased_and_seeded():
    torch.manual_seed(0)
    source = torch.randn(128)  # one block
    trials = 200
    # The block repeated: each copy draws other noise (hashed from each value's index), so one
    # launch rounds it 200 times.
    copies = source.repeat(trials)
    packed = aq_quantize_triton(copies, 1, 2, 128, True, draw_seed())
    shape = torch.Size([copies.numel()])
    rounded = aq_dequantize_triton(*packed, shape, torch.float32, 2, 1, 128).view(trials, 128)
    scale = packed[2].max().item()
    assert (rounded.mean(0) - source).abs().max().item() < 5 * scale / math.sqrt(trials)
    assert (rounded != rounded[0]).any(dim=1).float().mean() > 0.9  # the copies' noise differs
    first = aq_quantize_triton(source, 1, 2, 128, True, 1234)[0]
    assert torch.equal(aq_quantize_triton(source, 1, 2, 128, True, 1234)[0], first)
    assert not torch.equal(aq_quantize_triton(source, 1, 2, 128, True, 4321)[0], first)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,block", [(1, 32), (2, 64), (4, 128), (8, 256), (3, 32)])
def test_blpa_kernel_matches_twin(bits, block, dtype):
    torch.manual_seed(bits)
    source = (torch.randn(3001) * 2).to(dtype)
    source[:4] = torch.tensor([0.0, -0.0, 1e-3, -1e-3]).to(dtype)
    got = blpa_quantize_triton(source, bits, block)
    expected = blpa_quantize_reference(source, bits, block)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    shape = torch.Size([3001])
    out = blpa_dequantize_triton(*expected, shape, dtype, bits, block)
    assert torch.equal(out, blpa_dequantize_reference(*expected, shape, dtype, bits, block))


@pytest.mark.parametrize("bits", [3, 4, 7])
def test_blpa_kernel_matches_twin_over_several_tiles(bits):
    torch.manual_seed(bits)
    source = torch.randn(9001).to(torch.float16)  # 3 programs of 4096, a partial last block
    got = blpa_quantize_triton(source, bits, 32)
    expected = blpa_quantize_reference(source, bits, 32)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    shape = torch.Size([9001])
    out = blpa_dequantize_triton(*expected, shape, torch.float16, bits, 32)
    assert torch.equal(out, blpa_dequantize_reference(*expected, shape, torch.float16, bits, 32))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.bfloat16])
def test_mask_kernels_match_twin(dtype):
    torch.manual_seed(0)
    x = (torch.rand(5000) > 0.4).to(dtype)
    packed = mask_pack_triton(x)
    assert torch.equal(packed, mask_pack_reference(x))
    shape = torch.Size([50, 100])
    assert torch.equal(
        mask_unpack_triton(packed, shape, dtype),
        mask_unpack_reference(packed, shape, dtype),
    )


def test_block_sizes_are_the_compiled_ones():
    assert BLOCK_SIZES == (32, 64, 128, 256)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("block,capacity", [(64, 0.375), (128, 0.0), (256, 0.375), (64, 1.0)])
def test_smaq_kernels_match_twin_bit_for_bit(block, capacity, stochastic, dtype, monkeypatch):
    from hf_actq.codecs import SmaQCodec

    torch.manual_seed(block)
    n = 5000  # several programs' tiles, and a partial last block
    source = (torch.randn(n) * 2 + 0.5).to(dtype)
    source[:70] = 4.0  # a crowded block overflows its extension slots
    source[3000:3003] = -4.0  # a block whose outliers fill less than one extension byte
    source[3003:3200] = 0.5
    slots = SmaQCodec(block_size=block, capacity=capacity).slots
    # The kernels' buffers start as garbage, not as the zeros fresh memory often is: every byte
    # they keep must be stored.
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).fill_(170))
    main, extension, stats = smaq_quantize_triton(source, block, slots, stochastic, 4321)
    torch.testing.assert_close(stats, smaq_stats_reference(source), rtol=2e-6, atol=0)
    # Given the kernel's statistics (the twin's, to fp32 rounding), the twin's codes.
    expected = smaq_codes_reference(source, stats, block, slots, stochastic, 4321)
    assert torch.equal(main, expected[0]) and torch.equal(extension, expected[1])
    assert len({t.untyped_storage().data_ptr() for t in (main, extension, stats)}) == 1
    shape = torch.Size([n])
    out = smaq_dequantize_triton(main, extension, stats, shape, dtype, block, slots)
    monkeypatch.undo()
    twin = smaq_dequantize_reference(main, extension, stats, shape, dtype, block, slots)
    assert torch.equal(out, twin)


@pytest.mark.parametrize(
    "shape,stochastic,dtype",
    [
        ((2, 64, 2, 64), True, torch.bfloat16),
        ((1, 32, 2, 128), False, torch.float32),
        ((1, 8, 2, 512), True, torch.float32),
    ],
    ids=["dim 64, 2 batches, bf16", "dim 128, nearest", "dim 512"],
)
def test_smaq_kernels_pack_a_transposed_view_where_it_lies_as_its_flat_copy(
    shape, stochastic, dtype
):
    """Attention's q, k and v ([batch, heads, seq, dim] views of [batch, seq, heads, dim]) whose
    heads hold whole statistics tiles: the statistics and the codes of the flat copy, bit for
    bit (the same tiles, the same values in the same order)."""
    torch.manual_seed(shape[-1])
    view = torch.randn(shape).to(dtype).transpose(1, 2)
    assert strided_tiles(view) is not None
    got = smaq_quantize_triton(view, 256, 96, stochastic, 31)
    expected = smaq_quantize_triton(view.reshape(-1), 256, 96, stochastic, 31)
    for got_buffer, expected_buffer in zip(got, expected, strict=True):
        assert torch.equal(got_buffer, expected_buffer)


@pytest.mark.parametrize(
    "view",
    [
        _strided((2, 10, 3, 128)),  # a head's values end inside a statistics tile
        _strided((1, 2, 2, 4096)),  # rows wider than a quantize tile
    ],
    ids=["heads inside a tile", "dim 4096"],
)
def test_smaq_kernels_copy_other_strided_views_first(view):
    assert strided_tiles(view) is None
    got = smaq_quantize_triton(view, 64, 24, True, 5)
    for got_buffer, expected_buffer in zip(
        got, smaq_quantize_triton(view.contiguous(), 64, 24, True, 5)
    ):
        assert torch.equal(got_buffer, expected_buffer)


def test_smaq_kernel_reads_a_seed_on_the_device_as_the_host_seed():
    generator = torch.Generator(torch.get_default_device()).manual_seed(3)
    source = torch.randn(512, generator=generator)
    device_seed = torch.tensor([123457], dtype=torch.int64)
    got = smaq_quantize_triton(source, 64, 24, True, 0, device_seed)
    expected = smaq_quantize_triton(source, 64, 24, True, 123457)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(smaq_quantize_triton(source, 64, 24, True, 1)[0], got[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 4095, 4096 * 3 + 17])
def test_smaq_stats_kernel_matches_twin_and_fp64(n, dtype):
    """One read of the tensor: per tile, sums about the tile's first value (no cancellation
    against a large mean), combined in fp64. Kernel and twin agree to fp32 rounding, and both
    give fp64's mean and standard deviation, here of values far from zero."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(n)
    source = (torch.randn(n, generator=generator) * 0.5 + 300.0).to(dtype)
    got, twin = smaq_stats_triton(source), smaq_stats_reference(source)
    exact = source.double()
    expected = torch.stack([exact.mean(), exact.std(correction=0)]).float()
    torch.testing.assert_close(got, twin, rtol=2e-6, atol=0)
    torch.testing.assert_close(twin, expected, rtol=2e-6, atol=1e-7)


def test_smaq_stats_kernel_combines_its_partials_chunk_by_chunk(monkeypatch):
    """One program combines the tiles' partials (fp64, as the twin), a chunk of tiles at a time:
    chunks of 2 over 7 tiles (a partial last chunk, a partial last tile) give the twin's."""
    from hf_actq.kernels import smaq

    monkeypatch.setattr(smaq, "COMBINE_CHUNK", 2)
    generator = torch.Generator(torch.get_default_device()).manual_seed(11)
    source = torch.randn(4096 * 6 + 5, generator=generator) * 3 - 40.0
    torch.testing.assert_close(
        smaq_stats_triton(source), smaq_stats_reference(source), rtol=2e-6, atol=0
    )


def test_smaq_stats_of_nothing_and_of_a_nan():
    assert torch.equal(smaq_stats_triton(torch.empty(0)), torch.zeros(2))
    source = torch.ones(5000)
    source[4500] = float("nan")
    assert smaq_stats_triton(source).isnan().all() and smaq_stats_reference(source).isnan().all()


def test_smaq_stats_twin_reduces_chunk_by_chunk(monkeypatch):
    """The twin's transients are bounded by its chunk: a tensor of several chunks gives what
    one chunk over all of it gives."""
    from hf_actq.kernels import smaq

    generator = torch.Generator(torch.get_default_device()).manual_seed(5)
    source = torch.randn(4096 * 5 + 3, generator=generator) + 7.0
    whole = smaq_stats_reference(source)
    monkeypatch.setattr(smaq, "STATS_CHUNK_TILES", 2)
    assert torch.equal(smaq_stats_reference(source), whole)
