"""The compressed MoE experts op against transformers' grouped-matmul experts."""

from contextlib import nullcontext

import pytest
import torch
from transformers import MixtralConfig
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hf_actq.codecs.packed import ExactCodec
from hf_actq.ops.fewbit_activation import ActivationTable
from hf_actq.ops.moe_experts import compressed_experts_forward, supports_experts
from hf_actq.ops.state import STATE, OpState, set_state
from hf_actq.testing import experts_step, routed_tokens

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 40, 32, 48, 5, 2


def _experts(dtype=torch.float32, codec=None):
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    experts = experts.to(dtype)
    state = OpState(path="experts", experts_fallback="grouped_mm")
    state.activation = ActivationTable("silu", 4)
    state.codecs = {"gate": codec or ExactCodec(), "up": codec or ExactCodec()}
    set_state(experts, state)
    return experts


def _routing(dtype=torch.float32):
    return routed_tokens(TOKENS, HIDDEN, EXPERTS, TOP_K, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_is_grouped_mm_bit_for_bit_and_gradients_follow_it(dtype):
    experts = _experts(dtype)
    hidden, index, weights = _routing(dtype)
    grad = torch.randn(TOKENS, HIDDEN).to(dtype)
    out, grads, stock_bytes = experts_step(
        grouped_mm_experts_forward, experts, hidden, index, weights, grad
    )
    ours, our_grads, our_bytes = experts_step(
        compressed_experts_forward, experts, hidden, index, weights, grad
    )
    assert torch.equal(ours, out)
    # Exact operands; only act'(gate) is a 4-bit few-bit code (and bf16 rounds differently).
    for name, a in our_grads.items():
        b = grads[name]
        cosine = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0)
        assert cosine > (0.999 if dtype == torch.float32 else 0.99), name
    # Per routed row stock keeps the gathered input, gate, act(gate), up, the product and the
    # down output; this op act(gate), up and a 4-bit code, and the input once per token.
    rows = TOKENS * TOP_K
    assert our_bytes < stock_bytes - rows * (HIDDEN + INTER) * ours.element_size()


def test_compressed_operands_keep_fewer_bytes_and_close_gradients():
    from hf_actq.codecs import uniform

    hidden, index, weights = _routing()
    grad = torch.randn(TOKENS, HIDDEN)
    exact = experts_step(compressed_experts_forward, _experts(), hidden, index, weights, grad)
    packed = experts_step(
        compressed_experts_forward, _experts(codec=uniform(8)), hidden, index, weights, grad
    )
    # Two fp32 operands at 8 bits: 3 of 4 bytes per element saved, less the block scales.
    assert packed[2] < exact[2] - 2 * TOKENS * TOP_K * INTER * 2.5
    for a, b in zip(packed[1].values(), exact[1].values(), strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0) > 0.99


def test_without_grad_or_state_it_runs_the_previous_implementation():
    experts = _experts()
    hidden, index, weights = _routing()
    want = grouped_mm_experts_forward(experts, hidden, index, weights)
    with torch.no_grad():
        assert torch.equal(compressed_experts_forward(experts, hidden, index, weights), want)
    experts.__dict__.pop(STATE)
    assert torch.equal(compressed_experts_forward(experts, hidden, index, weights), want)


def test_other_layouts_are_not_claimed():
    experts = _experts()
    assert supports_experts(experts)
    experts.is_transposed = True
    assert not supports_experts(experts)
    assert not supports_experts(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_gradients_leave_the_routed_counts_on_the_device(dtype, monkeypatch):
    """The experts' weight gradients are grouped matmuls over the routed counts, as the
    grouped-matmul experts' own autograd computes them: a per-expert loop read the counts on the
    host (``tolist``), one GPU sync per MoE layer per step. The same gradients as that loop,
    zeros for an expert without rows."""
    experts = _experts(dtype)
    hidden, index, weights = _routing(dtype)
    grad = torch.randn(TOKENS, HIDDEN).to(dtype)

    def weight_grads(backward_reads_host: bool):
        experts.zero_grad()
        out = compressed_experts_forward(experts, hidden, index, weights)
        with monkeypatch.context() as patch:
            if not backward_reads_host:
                patch.setattr(torch.Tensor, "tolist", lambda tensor: pytest.fail("a host read"))
            out.backward(grad)
        return experts.gate_up_proj.grad, experts.down_proj.grad

    grouped = weight_grads(backward_reads_host=False)
    assert not grouped[0][-1].any() and not grouped[1][-1].any()
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")  # the loop, where it cannot run
    looped = weight_grads(backward_reads_host=True)
    for a, b in zip(grouped, looped):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _one_kernel_against_the_composition(monkeypatch, dtype, kernel, composition):
    """The experts op with uniform 4-bit operands, the kernels run (by the interpreter on the
    CPU): ``(output, gradients, saved bytes)`` once with the kernel op ``kernel`` (launched
    once) and once with ``composition`` (a ``(module, name)`` patched to refuse it)."""
    from hf_actq.codecs import uniform
    from hf_actq.kernels import kernels_on_cpu
    from hf_actq.kernels.registry import KERNELS

    experts = _experts(dtype, codec=uniform(4))
    experts.__dict__[STATE].activation = ActivationTable("relu", 1)
    hidden, index, weights = _routing(dtype)
    grad = torch.randn(TOKENS, HIDDEN).to(dtype)
    launches = []
    launcher = KERNELS[kernel].launcher
    monkeypatch.setattr(KERNELS[kernel], "launcher", lambda *a: launches.append(1) or launcher(*a))

    def run():
        torch.manual_seed(0)
        with kernels_on_cpu():
            return experts_step(compressed_experts_forward, experts, hidden, index, weights, grad)

    fused = run()
    assert len(launches) == 1
    monkeypatch.setattr(*composition, lambda *args: None)
    composed = run()
    assert len(launches) == 1
    return fused, composed


def _assert_same(fused, composed):
    assert torch.equal(fused[0], composed[0]) and fused[2] == composed[2]
    for a, b in zip(fused[1].values(), composed[1].values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_product_backward_is_one_kernel_over_the_packed_operands(dtype, monkeypatch):
    """Backward reads act(gate) and up from their packs in one ``gated_backward`` launch
    (gradients of gate and up, and the product the routing weights and the down projection
    need), where two unpacks, three products and the few-bit backward ran: the same gradients
    bit for bit."""
    from hf_actq.ops import gated_mlp

    composition = (gated_mlp, "_one_kernel_takes")  # None: falsy, the composition runs
    _assert_same(*_one_kernel_against_the_composition(monkeypatch, dtype, "gated_backward",
                                                      composition))  # fmt: skip


@pytest.mark.needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_forward_reads_gate_and_up_in_place_in_one_kernel(dtype, monkeypatch):
    """act(gate), the product, the codes and both packs from one ``gated_forward`` launch that
    reads gate and up as the halves of the projection's output (where the few-bit forward is
    exact: forced here for relu, whose Triton formula the interpreter computes exactly): the
    output, the saved bytes and the gradients of the op-by-op path, bit for bit."""
    from hf_actq.kernels import gated_product
    from hf_actq.kernels.fewbit import EXACT_OPTION_CANDIDATES
    from hf_actq.ops import moe_experts

    monkeypatch.setattr(
        gated_product, "exact_forward_options", lambda *args: EXACT_OPTION_CANDIDATES[0]
    )
    composition = (moe_experts, "product_forward")
    _assert_same(*_one_kernel_against_the_composition(monkeypatch, dtype, "gated_forward",
                                                      composition))  # fmt: skip


@pytest.mark.parametrize("op", ["compressed", "recomputed gate"])
def test_frozen_experts_keep_no_input_and_compiled_autograd_runs_their_backward(op, monkeypatch):
    """Frozen experts keep nothing of their input (its gradient needs the weights only), in
    both experts ops (the recomputed gate's on gpt-oss's layout). Compiled autograd traces the
    backward apart from the eager forward that kept none: the traced backward stands zeros in
    for it (only the frozen weight's discarded gradient reads them) and gives eager's
    gradients."""
    from test_moe_experts_recomputed import _experts as recomputed_gate_experts

    from hf_actq.codecs import uniform
    from hf_actq.ops import dedup, moe_experts, moe_experts_recomputed, moe_routing

    def make():
        if op == "compressed":
            return _experts(codec=uniform(4))
        return recomputed_gate_experts("gpt_oss", codec=uniform(4))

    module = moe_experts if op == "compressed" else moe_experts_recomputed

    monkeypatch.setattr(dedup, "_step_seed_advances", lambda: False)  # eager's draws in both
    gathered = []  # the kept input's size at each gather of it

    def input_rows(ctx, load, *args):
        gathered.append(load().numel())
        return moe_routing.input_rows(ctx, load, *args)

    monkeypatch.setattr(module, "input_rows", input_rows)
    hidden, index, weights = _routing()
    grad = torch.randn(TOKENS, HIDDEN)
    kept = {}
    for frozen in (False, True):
        experts = make()
        experts.requires_grad_(not frozen)
        kept[frozen] = experts_step(
            compressed_experts_forward, experts, hidden, index, weights, grad
        )[2]
    assert kept[True] == kept[False] - TOKENS * HIDDEN * 4
    gathered.clear()  # the trained experts' eager backward gathered theirs
    results = []
    for compiled in (False, True):
        experts = make()
        experts.requires_grad_(False)
        backend = torch.compile(backend="aot_eager")
        traced = torch._dynamo.compiled_autograd._enable(backend) if compiled else nullcontext()
        torch.manual_seed(0)
        with traced:
            results.append(
                experts_step(
                    compressed_experts_forward, experts, hidden, index, weights, grad, metered=False
                )[1]
            )
    torch._dynamo.reset()
    assert gathered == [0]  # the traced backward's, of the empty stand-in
    eager, compiled = results
    for name in ("hidden", "routing weights"):
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)
