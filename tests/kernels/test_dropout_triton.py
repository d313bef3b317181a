"""The seeded dropout kernel under the Triton interpreter, against its PyTorch twin: the same
mask law (not the same bits: Philox against torch's generator) and the same arithmetic."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("HF_ACTQ_TEST_DEVICE") != "cuda":
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported, or HF_ACTQ_TEST_DEVICE=cuda",
        allow_module_level=True,
    )

from hf_actq.kernels.dropout import (
    seeded_dropout_reference,  # noqa: E402
    seeded_dropout_triton,  # noqa: E402
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_seeded_dropout_kernel_matches_its_twin_in_law_and_arithmetic(dtype, p):
    torch.manual_seed(0)
    n = 20_000 + 3  # not a multiple of the block
    x = (torch.randn(n) * 3).to(dtype)
    out = seeded_dropout_triton(x, p, seed=1234)
    kept = out != 0
    # The kept elements are the twin's x * (1 / (1 - p)), rounded once.
    torch.testing.assert_close(out[kept], (x * (1.0 / (1.0 - p)))[kept], rtol=0, atol=0)
    # The same seed gives the same mask (backward redraws it), another seed another mask.
    assert torch.equal(seeded_dropout_triton(torch.ones(n, dtype=dtype), p, 1234) != 0, kept)
    assert not torch.equal(seeded_dropout_triton(x, p, 1235) != 0, kept)
    # Keep rate 1 - p within 4 standard deviations, as the twin's.
    twin_kept = seeded_dropout_reference(torch.ones(n), p, 1234) != 0
    tolerance = 4 * (p * (1 - p) / n) ** 0.5
    for rate in (kept.float().mean().item(), twin_kept.float().mean().item()):
        assert abs(rate - (1 - p)) < tolerance
    # Independent of position: both halves keep at the same rate.
    first, second = kept[: n // 2].float().mean(), kept[n // 2 :].float().mean()
    assert abs(first - second) < 2 * tolerance


def test_seeded_dropout_kernel_keeps_nan_of_dropped_infinities_as_torch_does():
    x = torch.tensor([float("inf")] * 64)
    # inf * keep * scale: kept -> inf, dropped -> inf * 0 = nan (torch's x * mask does the same).
    out = seeded_dropout_triton(x, 0.5, seed=7)
    assert out.isnan().any() and out.isinf().any() and not (out == 0).any()
    assert seeded_dropout_reference(x, 0.5, 7).isnan().any()


def test_each_value_of_a_philox_call_keeps_independently():
    # Element e takes output e % 4 of Philox counter e // 4, 8 elements (two calls) a thread:
    # each of the 8 lanes keeps at 1 - p, and two lanes, of one call or of two, keep together at
    # (1 - p)**2, as independent draws do.
    n, p = 8 * 20_000, 0.5
    kept = (seeded_dropout_triton(torch.ones(n), p, seed=99) != 0).view(-1, 8).float()
    tolerance = 4 * (0.25 / (n // 8)) ** 0.5
    for lane in range(8):
        assert abs(kept[:, lane].mean().item() - (1 - p)) < tolerance
    for a, b in [(0, 1), (2, 3), (3, 4), (6, 7), (0, 7), (1, 5)]:
        assert abs((kept[:, a] * kept[:, b]).mean().item() - (1 - p) ** 2) < tolerance
