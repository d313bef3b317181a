"""The experts op for other layouts and gates (the gate recomputed in backward from the packed
projection) against transformers' grouped-matmul experts: gpt-oss (transposed, biased,
interleaved, a clamped GLU of its own), Aria (transposed), Nemotron-H (no gate: ReLU^2)."""

import pytest
import torch
from transformers import AriaTextConfig, GptOssConfig, MixtralConfig, NemotronHConfig
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.aria.modeling_aria import AriaExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

from hf_actq import SavedTensorMeter
from hf_actq.codecs.packed import ExactCodec
from hf_actq.ops.moe_experts import compressed_experts_forward, supports_experts
from hf_actq.ops.moe_experts_recomputed import supports_recomputed_gate
from hf_actq.ops.state import OpState, set_state
from hf_actq.testing import experts_step, routed_tokens

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 40, 32, 48, 5, 2

LAYOUTS = {
    "gpt_oss": lambda: GptOssExperts(
        GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    ),
    "aria": lambda: AriaExperts(
        AriaTextConfig(hidden_size=HIDDEN, intermediate_size=INTER, moe_num_experts=EXPERTS)
    ),
    "nemotron_h": lambda: NemotronHExperts(
        NemotronHConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS)
    ),
}


def _experts(layout, dtype=torch.float32, codec=None):
    torch.manual_seed(0)
    experts = LAYOUTS[layout]()
    with torch.no_grad():
        for parameter in experts.parameters():
            # Wide enough that gpt-oss's clamps (at 7) cut some values.
            parameter.normal_(0, 1.0 if parameter.dim() == 3 else 2.0)
    experts = experts.to(dtype)
    state = OpState(path="experts", experts_fallback="grouped_mm")
    state.codecs = {"gate_up": codec or ExactCodec()}
    set_state(experts, state)
    return experts


def _routing(dtype=torch.float32):
    return routed_tokens(TOKENS, HIDDEN, EXPERTS, TOP_K, dtype)


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_is_grouped_mm_bit_for_bit_and_gradients_are_stock(layout, dtype):
    """With the projection kept exactly, every gradient (input, routing weights, each weight
    and bias) is stock's up to rounding: the gate's derivative is the gate's own, taken at the
    same point. Per routed row stock keeps the gathered input, the projection, the gate's
    intermediates, the product and the down output; this op the projection."""
    experts = _experts(layout, dtype)
    assert supports_recomputed_gate(experts) and not supports_experts(experts)
    hidden, index, weights = _routing(dtype)
    if layout == "gpt_oss":  # the projection crosses the gate's clamps (at 7): both are tested
        with torch.no_grad():
            projection = hidden @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
        assert (projection.float().abs() > experts.limit).float().mean() > 0.01
    grad = torch.randn(TOKENS, HIDDEN).to(dtype)
    out, grads, stock_bytes = experts_step(
        grouped_mm_experts_forward, experts, hidden, index, weights, grad
    )
    ours, our_grads, our_bytes = experts_step(
        compressed_experts_forward, experts, hidden, index, weights, grad
    )
    assert torch.equal(ours, out)
    assert our_grads.keys() == grads.keys()
    for name in grads:
        if dtype == torch.float32:
            torch.testing.assert_close(our_grads[name], grads[name], rtol=1e-4, atol=1e-4)
        else:
            assert _cosine(our_grads[name], grads[name]) > 0.99, name
    assert not our_grads["down_proj"][-1].any()  # the expert without rows
    rows = TOKENS * TOP_K
    assert our_bytes < stock_bytes - rows * (HIDDEN + INTER) * ours.element_size()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_packed_projection_keeps_fewer_bytes_and_close_gradients(layout):
    from hf_actq.codecs import uniform

    hidden, index, weights = _routing()
    grad = torch.randn(TOKENS, HIDDEN)
    exact = experts_step(compressed_experts_forward, _experts(layout), hidden, index, weights, grad)
    packed = experts_step(
        compressed_experts_forward,
        _experts(layout, codec=uniform(8)),
        hidden,
        index,
        weights,
        grad,
    )
    width = 2 * INTER if layout != "nemotron_h" else INTER
    # The fp32 projection at 8 bits: 3 of 4 bytes per element saved, less the block scales.
    assert packed[2] < exact[2] - TOKENS * TOP_K * width * 2.5
    for name in exact[1]:
        assert _cosine(packed[1][name], exact[1][name]) > 0.99, name


def test_without_grad_or_in_eval_it_runs_the_previous_implementation():
    experts = _experts("gpt_oss")
    hidden, index, weights = _routing()
    want = grouped_mm_experts_forward(experts, hidden, index, weights)
    with torch.no_grad():
        assert torch.equal(compressed_experts_forward(experts, hidden, index, weights), want)
    experts.eval()
    with SavedTensorMeter(exclude=list(experts.parameters())) as meter:
        hidden.requires_grad_()
        got = compressed_experts_forward(experts, hidden, index, weights)
    stock = SavedTensorMeter(exclude=list(experts.parameters()))
    with stock:
        grouped_mm_experts_forward(experts, hidden, index, weights)
    assert torch.equal(got, want) and meter.nbytes == stock.nbytes


def test_weight_gradients_leave_the_routed_counts_on_the_device(monkeypatch):
    """No host read of the routed counts in backward (a GPU sync per MoE layer per step):
    grouped matmuls for the weights, a segment sum for the biases."""
    experts = _experts("gpt_oss")
    hidden, index, weights = _routing()
    out = compressed_experts_forward(experts, hidden, index, weights)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: pytest.fail("a host read"))
    monkeypatch.setattr(torch.Tensor, "item", lambda tensor: pytest.fail("a host read"))
    out.backward(torch.randn(TOKENS, HIDDEN))
    assert experts.gate_up_proj.grad is not None and experts.down_proj_bias.grad is not None


def test_experts_with_a_parameter_of_their_own_are_not_claimed():
    """A gate function could read a parameter the op does not take as an input, whose gradient
    would be lost: such experts stay as they are."""
    experts = _experts("gpt_oss")
    assert supports_recomputed_gate(experts)
    experts.gate_scale = torch.nn.Parameter(torch.ones(1))
    assert not supports_recomputed_gate(experts)
    experts = _experts("gpt_oss")
    experts.has_post_expert_norm = True
    assert not supports_recomputed_gate(experts)


def test_the_default_layout_with_its_gate_recomputed_gives_stock_gradients():
    """Mixtral's layout, for an activation no few-bit table covers (ReLU^2)."""
    config = MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, hidden_act="relu2"
    )
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0, 0.3)
    state = OpState(path="experts", experts_fallback="grouped_mm")
    state.codecs = {"gate_up": ExactCodec()}
    set_state(experts, state)
    hidden, index, weights = _routing()
    grad = torch.randn(TOKENS, HIDDEN)
    stock = experts_step(grouped_mm_experts_forward, experts, hidden, index, weights, grad)
    ours = experts_step(compressed_experts_forward, experts, hidden, index, weights, grad)
    assert torch.equal(ours[0], stock[0])
    for name in stock[1]:
        torch.testing.assert_close(ours[1][name], stock[1][name], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["gpt_oss", "nemotron_h"])
def test_compiled_gradients_equal_the_eager_ones(layout, monkeypatch):
    """Under torch.compile (one graph: fullgraph) the backward differentiates the gate with
    torch.func.vjp and runs the grouped matmuls' gradients through hf_actq's grouped-matmul
    operator: eager's gradients."""
    from hf_actq.codecs import uniform
    from hf_actq.ops import dedup

    # The same rounding draws in both runs: from torch's RNG, as eager takes them, even where a
    # patched model another test left alive would make a trace key them by the step seed.
    monkeypatch.setattr(dedup, "_step_seed_advances", lambda: False)

    hidden, index, weights = _routing()
    grad = torch.randn(TOKENS, HIDDEN)
    results = []
    for compiled in (False, True):
        experts = _experts(layout, codec=uniform(4))
        forward = compressed_experts_forward
        if compiled:
            torch._dynamo.reset()
            forward = torch.compile(forward, backend="aot_eager", fullgraph=True)
        torch.manual_seed(0)  # the same stochastic rounding
        results.append(experts_step(forward, experts, hidden, index, weights, grad, metered=False))
    (eager_out, eager, _), (compiled_out, compiled, _) = results
    torch.testing.assert_close(compiled_out, eager_out)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_gate_that_changes_its_input_in_place_is_refused():
    """The projection, kept exactly, is the tensor the gate gets: a gate that wrote it in
    place would leave backward a changed projection and wrong gradients without a word."""
    experts = _experts("gpt_oss")

    def in_place_gate(self, gate_up):
        return gate_up.clamp_(max=self.limit)[..., ::2]

    experts._apply_gate = in_place_gate.__get__(experts)
    hidden, index, weights = _routing()
    with pytest.raises(RuntimeError, match="changed its input in place"):
        experts_step(compressed_experts_forward, experts, hidden, index, weights, None)
