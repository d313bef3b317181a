"""The rotated codec's kernels (rotation inside the pack and the unpack) against their twins
(the matrix product, then AQ's twin), under the Triton interpreter or on a GPU."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_ACTQ_TEST_DEVICE") != "cuda":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported, or HF_ACTQ_TEST_DEVICE=cuda",
        allow_module_level=True,
    )

from hf_actq.codecs.rotated import RotatedSampleCodec, _fixed_rotation  # noqa: E402
from hf_actq.kernels import rotated  # noqa: E402
from hf_actq.kernels.average_quant import aq_layout  # noqa: E402
from hf_actq.kernels.packing import unpack_codes  # noqa: E402
from hf_actq.kernels.rotated import (  # noqa: E402
    coefficient_dtype,
    rotated_dequantize_reference,
    rotated_dequantize_triton,
    rotated_quantize_reference,
    rotated_quantize_triton,
)

# (bits, block, elements): partial rows of 128, partial blocks, partial tiles, 3-bit codes.
SHAPES = [(4, 128, 5000), (3, 256, 128 * 33), (1, 32, 300), (8, 64, 128 * 32 * 3 + 7)]


def _rotation(dtype):
    return _fixed_rotation(torch.get_default_device(), coefficient_dtype(dtype))


def _small_integers(n, seed):
    """Values whose rotated sums are exact in bf16 x bf16 -> fp32 in any order: the kernel's
    coefficients are then the twin's, bit for bit, however either sums."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return torch.randint(-8, 9, (n,), generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits,block,n", SHAPES)
def test_bf16_kernels_pack_and_unpack_the_twins_bits(bits, block, n, stochastic):
    x, rotation = _small_integers(n, bits), _rotation(torch.bfloat16)
    got = rotated_quantize_triton(x, rotation, bits, block, stochastic, 4321)
    expected = rotated_quantize_reference(x, rotation, bits, block, stochastic, 4321)
    for got_buffer, expected_buffer in zip(got, expected):
        assert torch.equal(got_buffer, expected_buffer)
    # Unpacked from coefficients that are small integers (exact sums again).
    pack, args = _integer_pack(n, bits, block), (rotation, [n], torch.bfloat16, bits, block)
    unpacked = rotated_dequantize_triton(*pack, *args)
    assert torch.equal(unpacked, rotated_dequantize_reference(*pack, *args))
    # Not vacuous: the rotation spreads each coefficient over its row of 128 values.
    coefficients = pack[1].repeat_interleave(block)[:n].to(torch.bfloat16)
    assert unpacked.abs().sum() > 0 and not torch.equal(unpacked, coefficients)


def _integer_pack(n, bits, block):
    """A pack of ``n`` values whose dequantized coefficients are small integers: random codes,
    integer minimums, scale 1."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(n)
    coeffs = rotated.cdiv(n, 128) * 128
    data = torch.randint(0, 256, (coeffs * bits // 8,), generator=generator).to(torch.uint8)
    mins = torch.randint(-8, 1, (rotated.cdiv(coeffs, block),), generator=generator).float()
    return data, mins, torch.ones_like(mins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("bits,block,n", SHAPES)
def test_fp32_coefficients_match_the_twin_to_rounding(bits, block, n, dtype):
    """fp32 coefficients (fp32 and fp16 inputs): three bf16 parts of each tile times the
    matrix's signs, fp32 sums in another order than the twin's: a code differs only where a
    coefficient sits on a rounding boundary."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(bits)
    x = (torch.randn(n, generator=generator) * 3).to(dtype)
    rotation = _rotation(dtype)
    got = rotated_quantize_triton(x, rotation, bits, block, False)
    expected = rotated_quantize_reference(x, rotation, bits, block, False)
    coeffs = rotated.cdiv(n, 128) * 128
    codes_got = unpack_codes(got[0], coeffs, bits).int()
    codes_expected = unpack_codes(expected[0], coeffs, bits).int()
    assert (codes_got - codes_expected).abs().max() <= 1
    assert (codes_got != codes_expected).float().mean() <= 1e-3
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-5, atol=1e-6)
    args = (rotation, [n], dtype, bits, block)
    unpacked = rotated_dequantize_triton(*expected, *args)
    reference = rotated_dequantize_reference(*expected, *args)
    # fp32 sums, rounded to the output's dtype (fp16: a value on a rounding boundary goes
    # either way, one fp16 step).
    rtol = 1e-5 if dtype == torch.float32 else 2**-10
    torch.testing.assert_close(unpacked, reference, rtol=rtol, atol=1e-5 * x.abs().max().item())


def test_three_bf16_parts_keep_fp32_tiles_fp32(monkeypatch):
    """Two parts keep 16 bits of each value: not fp32's coefficients (the check above fails);
    three keep all 24."""
    shape = rotated.tile_shape(torch.float32)
    monkeypatch.setattr(rotated, "tile_shape", lambda dtype: (shape[0], 2, shape[2]))
    with pytest.raises(AssertionError, match="not close"):
        test_fp32_coefficients_match_the_twin_to_rounding(8, 64, 5000, torch.float32)


def test_programs_that_rotate_several_tiles(monkeypatch):
    """Large tensors loop over several tiles a program (the matrix loaded once): 3 tiles a
    program over 7 tiles and a partial one, the last program running past the end."""
    monkeypatch.setattr(rotated, "_tiles_per_program", lambda n_tiles: 3)
    n = 128 * 32 * 7 + 1000  # tiles of 32 rows
    x = _small_integers(n, 7)
    # The codec's matrix is column-major (the transpose of a row-major one); either is read.
    for rotation in (_rotation(torch.bfloat16), _rotation(torch.bfloat16).contiguous()):
        got = rotated_quantize_triton(x, rotation, 4, 128, True, 99)
        expected = rotated_quantize_reference(x, rotation, 4, 128, True, 99)
        for got_buffer, expected_buffer in zip(got, expected):
            assert torch.equal(got_buffer, expected_buffer)
        pack, args = _integer_pack(n, 4, 128), (rotation, [n], torch.bfloat16, 4, 128)
        unpacked = rotated_dequantize_triton(*pack, *args)
        assert torch.equal(unpacked, rotated_dequantize_reference(*pack, *args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpus_before_sm80_take_the_composition_with_the_aq_kernels(monkeypatch, dtype):
    """No bf16 tensor-core products before sm_80 (T4, V100): the matrix product, then the AQ
    kernels, as before the fused kernels; the twin's codes and values on the same products."""
    from hf_actq.kernels import average_quant

    monkeypatch.setattr(rotated, "fused_on", lambda device: False)
    launched = []
    for name in ("aq_quantize_triton", "aq_dequantize_triton"):
        kernel = getattr(average_quant, name)
        monkeypatch.setattr(rotated, name, lambda *a, k=kernel: launched.append(k) or k(*a))
    x, rotation = (_small_integers(5000, 3) * 0.37).to(dtype), _rotation(dtype)
    got = rotated_quantize_triton(x, rotation, 4, 64, True, 5)
    expected = rotated_quantize_reference(x, rotation, 4, 64, True, 5)
    for got_buffer, expected_buffer in zip(got, expected):
        assert torch.equal(got_buffer, expected_buffer)
    args = (rotation, [5000], dtype, 4, 64)
    unpacked = rotated_dequantize_triton(*expected, *args)
    assert torch.equal(unpacked, rotated_dequantize_reference(*expected, *args))
    assert len(launched) == 2


@pytest.mark.parametrize("seed", [0, 987654, 2**31 - 2])
def test_the_kernel_reads_a_seed_on_the_device_as_the_host_seed(seed):
    x, rotation = _small_integers(5000, seed % 89), _rotation(torch.bfloat16)
    device_seed = torch.tensor([seed], dtype=torch.int64)
    got = rotated_quantize_triton(x, rotation, 4, 128, True, 0, device_seed)
    expected = rotated_quantize_reference(x, rotation, 4, 128, True, seed)
    for got_buffer, expected_buffer in zip(got, expected):
        assert torch.equal(got_buffer, expected_buffer)
    other = rotated_quantize_triton(x, rotation, 4, 128, True, 0, device_seed + 1)
    assert not torch.equal(other[0], got[0])


def test_the_pack_is_one_allocation_in_the_codecs_layout():
    codec = RotatedSampleCodec(bits=4, group_size=1)
    x = torch.randn(3, 300)
    data, mins, scales = rotated_quantize_triton(x, _rotation(x.dtype), 4, 128, True, 5)
    assert len({t.untyped_storage().data_ptr() for t in (data, mins, scales)}) == 1
    (codes_at, _, _), (mins_at, _, _), (scales_at, _, _) = codec.layout(x.shape)
    assert codec.layout(x.shape) == aq_layout(8 * 128, 4, 128)
    base = data.untyped_storage().data_ptr()
    offsets = [t.data_ptr() - base for t in (data, mins, scales)]
    assert offsets == [codes_at, mins_at, scales_at]
    empty = rotated_quantize_triton(torch.empty(0), _rotation(torch.float32), 4, 128, True, 5)
    assert all(t.numel() == 0 for t in empty)
    assert rotated_dequantize_triton(*empty, _rotation(torch.float32), [0, 4], torch.float32,
                                     4, 128).shape == (0, 4)  # fmt: skip
