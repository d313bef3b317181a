"""What the MoE experts ops share: the routing and the grouped matmul's gradient operator."""

import pytest
import torch

from hf_actq.ops.moe_routing import combine, grouped_mm_backward, route
from hf_actq.testing import routed_tokens

TOKENS, HIDDEN, OUT, EXPERTS, TOP_K = 24, 16, 12, 5, 2


def test_route_sorts_rows_by_expert_and_combine_sums_them_back_per_token():
    _, index, _ = routed_tokens(TOKENS, HIDDEN, EXPERTS, TOP_K)
    expert_ids, perm, offsets = route(index, EXPERTS)
    assert torch.equal(expert_ids, index.reshape(-1)[perm])
    assert torch.equal(offsets.diff(prepend=offsets.new_zeros(1)), torch.bincount(
        index.reshape(-1), minlength=EXPERTS).int())  # fmt: skip
    assert offsets[-1] == offsets[-2]  # the last expert has no row
    rows = torch.randn(TOKENS * TOP_K, OUT)
    want = rows.view(TOKENS, TOP_K, OUT).sum(1)
    torch.testing.assert_close(combine(rows[perm], perm, index.shape), want)


@pytest.mark.parametrize("transposed_view", [False, True])
def test_the_grouped_matmul_backward_is_autograds_per_expert_product(transposed_view):
    """Each expert's span of rows times its weight ([experts, in, out], or a transposed view of
    an [experts, out, in] weight, as the traced backwards pass it), differentiated: autograd's
    gradients of the per-expert products, and a well-formed operator (torch.library.opcheck)."""
    _, index, _ = routed_tokens(TOKENS, HIDDEN, EXPERTS, TOP_K)
    _, _, offsets = route(index, EXPERTS)
    rows = torch.randn(TOKENS * TOP_K, HIDDEN, requires_grad=True)
    stored = torch.randn(EXPERTS, OUT, HIDDEN) if transposed_view else torch.randn(
        EXPERTS, HIDDEN, OUT)  # fmt: skip
    weight = (stored.transpose(-2, -1) if transposed_view else stored).requires_grad_()
    grad_output = torch.randn(TOKENS * TOP_K, OUT)
    start, outputs = 0, []
    for expert, end in enumerate(offsets.tolist()):
        outputs.append(rows[start:end] @ weight[expert])
        start = end
    torch.cat(outputs).backward(grad_output)
    grad_rows, grad_weight = grouped_mm_backward(rows.detach(), weight.detach(), offsets,
                                                 grad_output)  # fmt: skip
    torch.testing.assert_close(grad_rows, rows.grad)
    torch.testing.assert_close(grad_weight, weight.grad)
    assert not grad_weight[-1].any()
    torch.library.opcheck(grouped_mm_backward, (rows.detach(), weight.detach(), offsets,
                                                grad_output))  # fmt: skip
