"""Packing is exact under autocast: every codec packs and unpacks the same bytes and values with
CPU bf16/fp16 autocast on as with it off (autocast runs matrix products in half precision,
whose mantissa cannot hold a packed word)."""

import pytest
import torch

from hf_actq.codecs import (
    AverageQuantCodec,
    MaskCodec,
    RotatedSampleCodec,
    SignPreservingCodec,
    SmaQCodec,
    uniform,
)
from hf_actq.kernels import fewbit_forward
from hf_actq.kernels.packing import pack_codes, unpack_codes

CODECS = [
    *(uniform(bits) for bits in range(1, 9)),
    AverageQuantCodec(2, 4),
    AverageQuantCodec(3, 2),
    AverageQuantCodec(2, 8, block_size=32),
    *(SignPreservingCodec(bits) for bits in (2, 3, 5)),
    SmaQCodec(),
    RotatedSampleCodec(bits=4, group_size=1),
    RotatedSampleCodec(bits=3, group_size=1),
    RotatedSampleCodec(bits=2, group_size=4),
    MaskCodec(),
]


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_codes_round_trips_under_autocast(bits, autocast_dtype):
    codes = torch.randint(0, 2**bits, (1003,), dtype=torch.uint8)
    with torch.autocast("cpu", dtype=autocast_dtype):
        packed = pack_codes(codes, bits)
        unpacked = unpack_codes(packed, codes.numel(), bits)
    assert torch.equal(unpacked, codes)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_codec_is_unchanged_by_autocast(codec, dtype, autocast_dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 7, 256).to(dtype)
    if isinstance(codec, MaskCodec):
        x = (x > 0).to(dtype)
    seed = 1234 if codec.uses_rng else None
    plain = codec.pack(x, seed)
    with torch.autocast("cpu", dtype=autocast_dtype):
        under = codec.pack(x, seed)
        unpacked_under = codec.unpack(under)
    for a, b in zip(plain.tensors, under.tensors, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(codec.unpack(plain), unpacked_under)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fewbit_forward_unchanged_by_autocast(bits):
    x = torch.randn(5, 1001)
    borders = torch.linspace(-2, 2, 2**bits + 1)[1:-1]
    plain = fewbit_forward(x, "gelu", borders, bits, [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = fewbit_forward(x, "gelu", borders, bits, [])
    assert all(torch.equal(a, b) for a, b in zip(plain, under, strict=True))
    assert under[0].dtype == torch.float32
