import math
import os

import numpy as np
import pytest
import torch

if os.environ.get("HF_ACTQ_TEST_DEVICE", "cpu") != "cpu":
    pytest.skip("the twins against NumPy: CPU tensors only", allow_module_level=True)

from hf_actq.fewbit import table_for
from hf_actq.kernels import fewbit, packing
from hf_actq.kernels.fewbit import fewbit_backward_reference, fewbit_forward_reference
from hf_actq.kernels.packing import pack_codes, packed_nbytes, unpack_codes


def _bf16_truncated(v: np.ndarray) -> np.ndarray:
    return (v.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _bitstream_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent oracle: code i at bits [i*bits, (i+1)*bits) of a little-endian stream."""
    stream = np.unpackbits(codes.astype(np.uint8)[:, None], axis=1, count=bits, bitorder="little")
    return np.packbits(stream.reshape(-1), bitorder="little")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4097])
@pytest.mark.parametrize("chunk", [packing.CHUNK, 64], ids=["one_chunk", "many_chunks"])
def test_pack_matches_bitstream_oracle_and_round_trips(bits, n, chunk, monkeypatch):
    monkeypatch.setattr(packing, "CHUNK", chunk)  # packing crosses chunks, the last partial
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 2**bits, size=n, dtype=np.uint8)
    packed = pack_codes(torch.from_numpy(codes), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    np.testing.assert_array_equal(packed.numpy(), _bitstream_pack(codes, bits))
    np.testing.assert_array_equal(unpack_codes(packed, n, bits).numpy(), codes)


@pytest.mark.parametrize("bits", [1, 3])
def test_chunk_boundaries_do_not_shift_codes(monkeypatch, bits):
    # A tiny chunk makes every path cross many chunk boundaries, including a partial last one.
    monkeypatch.setattr(fewbit, "CHUNK", 64)
    table = table_for("gelu", bits)
    x = torch.randn(1001)
    borders = torch.tensor(table.borders, dtype=torch.float32)
    _, packed, _ = fewbit_forward_reference(x, "gelu", borders, bits)
    codes = np.searchsorted(np.float32(table.borders), _bf16_truncated(x.numpy()), side="left")
    np.testing.assert_array_equal(packed.numpy(), _bitstream_pack(codes, bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,bits", [("gelu", 3), ("tanh", 2), ("relu6", 1), ("silu", 4)])
def test_backward_is_grad_times_level_of_code(name, bits, dtype):
    table = table_for(name, bits)
    x = (torch.randn(3000) * 4).to(dtype)
    borders = torch.tensor(table.borders, dtype=torch.float32)
    levels = torch.tensor(table.levels, dtype=torch.float32)
    y, packed, flag = fewbit_forward_reference(x, name, borders, table.bits)
    assert flag.item() == 0
    grad = torch.randn(3000).to(dtype)
    got = fewbit_backward_reference(grad, packed, levels, flag, table.bits)
    xv = x.float().numpy()
    if name == "tanh":
        codes = np.searchsorted(np.float32(table.borders), np.abs(_bf16_truncated(xv)), "left")
    elif name == "relu6":
        codes = ((xv > 0) & (xv < 6)).astype(np.int64)
    else:
        codes = np.searchsorted(np.float32(table.borders), _bf16_truncated(xv), side="left")
    expected = (grad.float() * levels[torch.from_numpy(codes)]).to(dtype)
    assert torch.equal(got, expected)


def test_nan_input_poisons_the_gradient_and_inf_does_not_crash():
    table = table_for("gelu", 3)
    borders = torch.tensor(table.borders, dtype=torch.float32)
    levels = torch.tensor(table.levels, dtype=torch.float32)
    x = torch.tensor([1.0, float("inf"), -float("inf"), 0.5])
    _, packed, flag = fewbit_forward_reference(x, "gelu", borders, 3)
    grad = fewbit_backward_reference(torch.ones(4), packed, levels, flag, 3)
    assert flag.item() == 0 and torch.isfinite(grad).all()
    assert grad[1] == levels[-1] and grad[2] == levels[0]
    x[3] = float("nan")
    _, packed, flag = fewbit_forward_reference(x, "gelu", borders, 3)
    grad = fewbit_backward_reference(torch.ones(4), packed, levels, flag, 3)
    assert flag.item() == 1 and torch.isnan(grad[3])


@pytest.mark.parametrize(
    "layout",
    [
        ((24, 10, torch.uint8), (0, 3, torch.float32), (12, 3, torch.float32)),  # AQ's order
        ((8, 5, torch.uint8), (0, 2, torch.float32), (16, 0, torch.uint8)),  # a gap, an empty
    ],
    ids=["tiled", "with a gap"],
)
def test_a_packs_views_lie_where_its_layout_places_them(layout):
    """One split of the allocation where the layout tiles it; slices where it does not: the
    same views either way."""
    allocation = packing.one_allocation(layout, "cpu")
    storage = allocation[0].untyped_storage()
    assert storage.nbytes() == packing.allocation_bytes(layout)
    for view, (offset, n, dtype) in zip(allocation, layout, strict=True):
        assert view.untyped_storage().data_ptr() == storage.data_ptr()
        where = view.storage_offset() * view.element_size()
        assert (where, view.numel(), view.dtype) == (offset, n, dtype)
    buffer = torch.arange(packing.allocation_bytes(layout), dtype=torch.uint8)
    for view, (offset, n, dtype) in zip(packing.views_of(buffer, layout), layout, strict=True):
        assert torch.equal(view, buffer[offset : offset + n * dtype.itemsize].view(dtype))


def test_packed_nbytes():
    assert [packed_nbytes(n, 3) for n in (0, 1, 8, 9, 2**31 + 1)] == [0, 1, 3, 4, 805306369]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("symmetric", [False, True])
def test_code_lookup_equals_comparisons_on_every_edge_case(dtype, symmetric):
    cuts = table_for("tanh" if symmetric else "gelu", 3).borders
    lut = fewbit.code_lookup_table(tuple(cuts), symmetric, dtype, torch.device("cpu"))
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 65504.0]
    near = [c * (1 + e) for c in cuts for e in (-1e-3, -1e-6, 0.0, 1e-6, 1e-3)]
    x = torch.tensor(special + near + torch.randn(10000).mul(5).tolist()).to(dtype)
    got = lut.index_select(0, fewbit._top16_bits(x))
    v = _bf16_truncated(x.float().numpy())
    if symmetric:
        v = np.abs(v)
    with np.errstate(invalid="ignore"):
        expected = (v[:, None] > np.float32(cuts)[None, :]).sum(axis=1)
    np.testing.assert_array_equal(got.numpy(), expected)
