"""The gated product's fused backward under the interpreter against its twin (the op-by-op
composition the gated MLP ran before): every output bit-identical."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_ACTQ_TEST_DEVICE") != "cuda":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported, or HF_ACTQ_TEST_DEVICE=cuda",
        allow_module_level=True,
    )

from hf_actq.codecs import AverageQuantCodec  # noqa: E402
from hf_actq.fewbit import table_for  # noqa: E402
from hf_actq.kernels.fewbit import fewbit_forward_reference  # noqa: E402
from hf_actq.kernels.gated_product import (  # noqa: E402
    gated_backward_reference,
    gated_backward_triton,
)


def _case(shape, dtype, a_codec, up_codec, bits=2, nan=False):
    generator = torch.Generator(torch.get_default_device()).manual_seed(sum(shape) + bits)
    gate, up, grad = (torch.randn(shape, generator=generator).to(dtype) * 3 for _ in range(3))
    if nan:
        gate.view(-1)[5] = float("nan")
    table = table_for("silu", bits)
    borders = torch.tensor(table.borders, dtype=torch.float32)
    levels = torch.tensor(table.levels, dtype=torch.float32)
    activated, codes, nan_flag = fewbit_forward_reference(gate, "silu", borders, bits)
    a_pack, up_pack = a_codec.pack(activated, seed=1), up_codec.pack(up, seed=2)
    spec = [[c.bits, c.group_size, c.block_size] for c in (a_codec, up_codec)]
    return (grad, *a_pack.tensors, *up_pack.tensors, codes, levels, nan_flag, *spec, bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "a_codec,up_codec",
    [
        (AverageQuantCodec(4, 1), AverageQuantCodec(4, 1)),
        (AverageQuantCodec(2, 4, block_size=64), AverageQuantCodec(3, 1, block_size=256)),
        (AverageQuantCodec(1, 16, block_size=256), AverageQuantCodec(8, 2, block_size=32)),
    ],
    ids=["uniform-4", "aq-mixed", "aq-extremes"],
)
@pytest.mark.parametrize("with_product", [False, True])
def test_the_kernel_matches_the_composition(dtype, a_codec, up_codec, with_product):
    # 3 x 1360 elements: two tiles and a part, a last dim that every group divides.
    args = _case((3, 1360), dtype, a_codec, up_codec)
    expected = gated_backward_reference(*args, with_product)
    got = gated_backward_triton(*args, with_product)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[2].numel() == (args[0].numel() if with_product else 0)


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_every_few_bit_width_and_a_nan(bits):
    codec = AverageQuantCodec(4, 1)
    for nan in (False, True):
        args = _case((5, 200), torch.bfloat16, codec, codec, bits=bits, nan=nan)
        expected = gated_backward_reference(*args, True)
        got = gated_backward_triton(*args, True)
        assert got[0].isnan().all() == nan  # the few-bit code cannot say where: all NaN
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.fixture
def verdict(monkeypatch):
    """Set what the few-bit forward's probe says (its options, or None), on the CPU as on a GPU:
    with its options the interpreter runs the one-pass kernel, relu's Triton formula being
    exact on these inputs."""
    from hf_actq.kernels import gated_product, kernels_on_cpu

    said = {"options": fewbit_options()[0]}
    monkeypatch.setattr(gated_product, "exact_forward_options", lambda *args: said["options"])
    with kernels_on_cpu():
        yield said


def fewbit_options():
    from hf_actq.kernels.fewbit import EXACT_OPTION_CANDIDATES

    return EXACT_OPTION_CANDIDATES


def _forward_case(shape, dtype, codecs, activation="relu", bits=1, nan=False):
    generator = torch.Generator(torch.get_default_device()).manual_seed(sum(shape))
    gate, up = (torch.randn(shape, generator=generator).to(dtype) * 3 for _ in range(2))
    if nan:
        gate.view(-1)[7] = float("nan")
    table = table_for(activation, bits)
    borders = torch.tensor(table.borders, dtype=torch.float32)
    layouts = [[c.bits, c.group_size, c.block_size, int(c.stochastic)] for c in codecs]
    return (gate, up, activation, borders, table.bits, [], *layouts, [11, 12])


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "codecs",
    [
        (AverageQuantCodec(4, 1), AverageQuantCodec(4, 1)),
        (AverageQuantCodec(2, 4, block_size=64), AverageQuantCodec(3, 1, stochastic=False)),
        (AverageQuantCodec(1, 16, block_size=256), AverageQuantCodec(8, 2, block_size=32)),
    ],
    ids=["uniform-4", "aq-mixed", "aq-extremes"],
)
def test_the_forward_kernel_matches_the_composition(verdict, dtype, codecs, monkeypatch):
    from hf_actq.kernels import gated_product

    launches = []
    kernel = gated_product.gated_forward_kernel
    monkeypatch.setattr(gated_product, "gated_forward_kernel", _Counting(kernel, launches))
    for nan in (False, True):
        args = _forward_case((3, 1360), dtype, codecs, nan=nan)
        got = gated_product.gated_forward_triton(*args)
        expected = gated_product.gated_forward_reference(*args)
        assert len(got) == len(expected) == 9
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and _same(a, b)
        assert got[2].item() == int(nan)
    assert len(launches) == 2  # one pass each


class _Counting:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("options", [None, "with contraction"])
def test_where_the_kernel_would_not_be_exact_the_composition_runs(verdict, options, monkeypatch):
    """No exact few-bit forward, or one only with FMA contraction (which would move the
    codecs' rounding): the composition's launches instead."""
    from hf_actq.kernels import gated_product

    verdict["options"] = None if options is None else fewbit_options()[1]
    assert verdict["options"] is None or verdict["options"]["enable_fp_fusion"]
    monkeypatch.setattr(gated_product, "gated_forward_kernel", None)  # would fail if launched
    codecs = (AverageQuantCodec(4, 1), AverageQuantCodec(4, 1))
    args = _forward_case((3, 1360), torch.float32, codecs)
    got = gated_product.gated_forward_triton(*args)
    expected = gated_product.gated_forward_reference(*args)
    assert all(_same(a, b) for a, b in zip(got, expected, strict=True))


# Each shape in one dtype (5-6 s a case under the interpreter): both dtypes and both shapes
# (3-d and 2-d) are read in place, and take the composition at a width not a multiple of 8.
@pytest.mark.parametrize(
    "shape,dtype", [((3, 5, 2 * 680), torch.bfloat16), ((7, 2 * 1376), torch.float32)], ids=str
)
def test_the_forward_kernel_reads_the_halves_of_one_projection_in_place(
    verdict, dtype, shape, monkeypatch
):
    """gate and up as ``gate_up.chunk(2, -1)`` (Phi-3's fused projection, MoE experts): rows
    ``2 x width`` apart, read in place by one launch, outputs contiguous and the composition's
    bit for bit. A width that is not a multiple of 8 (no vector loads along a row) takes the
    composition."""
    from hf_actq.kernels import gated_product

    launches = []
    kernel = gated_product.gated_forward_kernel
    monkeypatch.setattr(gated_product, "gated_forward_kernel", _Counting(kernel, launches))
    codecs = (AverageQuantCodec(4, 1), AverageQuantCodec(2, 4, block_size=64))
    generator = torch.Generator(torch.get_default_device()).manual_seed(3)
    for width, launched in ((shape[-1], 1), (shape[-1] - 8, 0)):
        gate_up = torch.randn(*shape[:-1], width, generator=generator).to(dtype) * 3
        gate, up = gate_up.chunk(2, dim=-1)
        assert not gate.is_contiguous() and gated_product.row_stride(gate) == width
        args = (gate, up, *_forward_case((1, 8), dtype, codecs)[2:])
        got = gated_product.gated_forward_triton(*args)
        expected = gated_product.gated_forward_reference(*args)
        assert got[0].is_contiguous() and got[0].shape == gate.shape
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and _same(a, b)
        assert len(launches) == launched
        launches.clear()


def test_row_stride_of_views():
    from hf_actq.kernels.gated_product import row_stride

    x = torch.empty(4, 5, 24)
    assert row_stride(x) == 24
    assert row_stride(x.chunk(2, -1)[1]) == 24
    assert row_stride(x[:, 1:, :12]) is None  # rows of one batch entry 24 apart, entries 120
    assert row_stride(x.transpose(0, 1)) is None
    assert row_stride(x[..., ::2]) is None  # the last dim strided
