"""The custom operators torch.compile traces (codecs, few-bit activation): real outputs match
the fake (shape-only) ones, and PyTorch's own registration checks pass (schema, fake tensors,
AOT dispatch with dynamic shapes)."""

import pytest
import torch

from hf_actq.codecs import (
    AverageQuantCodec,
    MaskCodec,
    RotatedSampleCodec,
    SignPreservingCodec,
    SmaQCodec,
)
from hf_actq.codecs.library import codec_from_key, pack_op, unpack_op
from hf_actq.codecs.packed import draw_seed_tensor
from hf_actq.kernels.packing import views_of

CODECS = [
    AverageQuantCodec(bits=4, group_size=1),
    AverageQuantCodec(bits=1, group_size=8, block_size=64, stochastic=False),
    AverageQuantCodec(bits=3, group_size=4),  # 30 % 4 != 0: partial groups
    RotatedSampleCodec(bits=2),
    RotatedSampleCodec(bits=4, group_size=1),  # 210 values: a partial last rotation
    SignPreservingCodec(bits=4, block_size=32),
    MaskCodec(),
    SmaQCodec(),
]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_pack_op_buffers_are_what_the_codec_declares(codec):
    x = torch.randn(3, 7, 30)
    seed = draw_seed_tensor() if codec.uses_rng else None
    buffers = pack_op(x, codec.op_key, seed)
    assert sum(b.numel() * b.element_size() for b in buffers) == codec.nbytes(x.shape)
    # A custom op's outputs may not alias: a codec whose tensors are views of one allocation
    # returns that allocation, which unpack_op takes apart by the codec's layout.
    layout = codec.layout(x.shape)
    tensors = buffers if layout is None else views_of(buffers[0], layout)
    assert len(buffers) == (len(tensors) if layout is None else 1)
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == len(buffers)
    declared = codec.buffers(x.shape)
    assert [(b.numel(), b.dtype) for b in tensors] == list(declared)
    assert codec_from_key(codec.op_key) == codec
    # The op is the codec: same seed, same buffers, same rebuilt tensor.
    direct = codec.pack(x, None if seed is None else int(seed.item()))
    assert all(torch.equal(a, b) for a, b in zip(tensors, direct.tensors))
    rebuilt = unpack_op(buffers, codec.op_key, list(x.shape), x.dtype)
    assert torch.equal(rebuilt, direct.unpack())


@pytest.mark.parametrize("codec", CODECS[:2] + CODECS[4:5], ids=repr)
def test_ops_pass_torch_library_opcheck(codec):
    x = torch.randn(4, 64)
    seed = draw_seed_tensor() if codec.uses_rng else None
    torch.library.opcheck(pack_op, (x, codec.op_key, seed))
    buffers = pack_op(x, codec.op_key, seed)
    torch.library.opcheck(unpack_op, (buffers, codec.op_key, list(x.shape), x.dtype))


def test_fewbit_ops_pass_torch_library_opcheck():
    from hf_actq.ops.fewbit_activation import ActivationTable

    table = ActivationTable("gelu", 3)
    borders, levels = table.tensors(torch.get_default_device())
    x = torch.randn(5, 24)
    forward_op = torch.ops.hf_actq.fewbit_forward.default
    torch.library.opcheck(forward_op, (x, "gelu", borders, 3, []))
    torch.library.opcheck(forward_op, (x.t(), "gelu", borders, 3, []))  # non-contiguous
    _, packed, nan_flag = forward_op(x, "gelu", borders, 3, [])
    backward_op = torch.ops.hf_actq.fewbit_backward.default
    torch.library.opcheck(backward_op, (torch.randn(5, 24), packed, levels, nan_flag, 3))


@pytest.mark.parametrize("codec", [c for c in CODECS if c.layout((3, 7, 30))], ids=repr)
def test_a_traced_pack_unpacks_outside_a_trace(codec):
    """A compiled forward's pack holds the pack op's one allocation; a backward that runs
    eagerly (packed checkpointing's, after a graph break) unpacks it as the codec's own pack."""
    from hf_actq.codecs.library import compiled_pack

    x = torch.randn(3, 7, 30)
    seed = draw_seed_tensor() if codec.uses_rng else None
    traced = compiled_pack(x, codec, seed)
    assert len(traced.tensors) == 1
    direct = codec.pack(x, None if seed is None else int(seed.item()))
    assert torch.equal(traced.unpack(), direct.unpack())
    assert traced.nbytes == direct.nbytes
