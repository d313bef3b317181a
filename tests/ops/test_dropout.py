import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hf_actq import SavedTensorMeter
from hf_actq.kernels.packing import CHUNK_ELEMENTS
from hf_actq.memory.peak import PeakMemory
from hf_actq.ops.dropout import CompressedDropout


@pytest.mark.parametrize("mode", ["seed", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_uses_the_forward_mask_and_keeps_little(mode, dtype):
    torch.manual_seed(0)
    x = torch.randn(16, 100, dtype=dtype, requires_grad=True)
    drop = CompressedDropout(0.1, mode)
    with SavedTensorMeter() as meter:
        y = drop(x)
    y.backward(torch.ones_like(y))
    keep = y != 0
    scale = torch.tensor(1 / 0.9, dtype=dtype)
    assert torch.equal(x.grad, keep.to(dtype) * scale)
    assert torch.equal(y, x.detach() * keep * (1 / 0.9))
    expected = 8 if mode == "seed" else math.ceil(x.numel() / 8)
    assert meter.nbytes == expected
    assert 0.05 < 1 - keep.float().mean().item() < 0.15


@pytest.mark.parametrize("mode", ["seed", "mask"])
def test_masks_are_drawn_in_chunks_without_a_full_size_fp32_random_tensor(mode):
    # A bf16 input three chunks and a bit long: no allocation in forward or backward exceeds the
    # input itself (torch.rand over it would be twice as large), and the gradient still uses
    # the forward's mask across the chunk boundaries.
    x = (torch.rand(3 * CHUNK_ELEMENTS + 5) + 0.5).to(torch.bfloat16).requires_grad_()  # no zeros
    drop = CompressedDropout(0.25, mode)
    with PeakMemory("cpu") as forward:
        y = drop(x)
    with PeakMemory("cpu") as backward:
        y.backward(torch.ones_like(y))
    input_bytes = x.numel() * x.element_size()
    assert forward.largest_bytes <= input_bytes and backward.largest_bytes <= input_bytes
    assert torch.equal(x.grad != 0, y != 0)
    assert abs((y != 0).float().mean().item() - 0.75) < 0.001


def test_eval_and_p_zero_are_identity_and_seeded_masks_reproduce():
    x = torch.randn(100, requires_grad=True)
    drop = CompressedDropout(0.3)
    drop.eval()
    assert drop(x) is x
    drop.train()
    torch.manual_seed(5)
    first = drop(x)
    torch.manual_seed(5)
    assert torch.equal(drop(x), first)
    assert CompressedDropout(0.0)(x) is x


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing(use_reentrant):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    layer = torch.nn.Sequential(lin, CompressedDropout(0.5), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    layer(x).sum().backward()
    expected = lin.weight.grad.clone()
    lin.zero_grad()
    torch.manual_seed(1)
    checkpoint(layer, x, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(lin.weight.grad, expected)


@pytest.mark.parametrize(
    "p,mode,match",
    [
        (1.5, "seed", "probability must be a number in"),
        (0.1, "bits", "mode must be one of seed, mask"),
    ],
)
def test_invalid_arguments(p, mode, match):
    with pytest.raises(ValueError, match=match):
        CompressedDropout(p, mode)
