import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_actq import SavedTensorMeter
from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.fewbit import table_for
from hf_actq.kernels import kernels_on_cpu
from hf_actq.kernels.registry import KERNELS
from hf_actq.ops import gated_mlp
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.gated_mlp import CompressedGatedMLP


def _mlp(act="silu", dtype=torch.float32):
    config = LlamaConfig(hidden_size=64, intermediate_size=176, hidden_act=act)
    torch.manual_seed(0)
    return LlamaMLP(config).to(dtype)


def _grads(module, params, x, grad):
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    module(x).backward(grad)
    return [x.grad] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_exact_forward_close_gradients(act, dtype):
    mlp = _mlp(act, dtype)
    module = CompressedGatedMLP(
        mlp, uniform(8, stochastic=False), activation_bits=4, cache=PackCache()
    )
    x = torch.randn(3, 10, 64).to(dtype).requires_grad_()
    assert torch.equal(module(x), mlp(x))
    grad = torch.randn(3, 10, 64).to(dtype)
    params = list(mlp.parameters())
    ours = _grads(module, params, x, grad)
    exact = _grads(mlp.float(), list(mlp.parameters()), x.float(), grad.float())
    for got, want in zip(ours, exact):
        cosine = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(), dim=0)
        assert cosine > 0.99


def test_keeps_no_full_intermediate_tensor():
    mlp = _mlp()
    codec = AverageQuantCodec(2, 4)
    module = CompressedGatedMLP(mlp, codec, activation_bits=1, cache=PackCache())
    x = torch.randn(4, 32, 64, requires_grad=True)
    params = list(mlp.parameters())
    with SavedTensorMeter(exclude=params) as baseline:
        mlp(x)
    with SavedTensorMeter(exclude=params) as ours:
        module(x)
    inter = (4, 32, 176)
    table = table_for("silu", 1)
    expected = (
        codec.nbytes(x.shape)  # x, shared by gate and up
        + (4 * 32 * 176 * table.bits + 7) // 8  # few-bit code of act'(gate)
        + 2 * codec.nbytes(inter)  # act(gate) and up
        + 2 * 4
        + 4  # level table (2 fp32) and NaN flag (int32)
    )
    assert ours.nbytes == expected
    assert baseline.nbytes / ours.nbytes > 25
    assert set(module.state_dict()) == set(mlp.state_dict())  # a drop-in replacement


def test_rejects_non_gated_modules():
    with pytest.raises(ValueError, match="needs gate_proj, up_proj, down_proj and act_fn"):
        CompressedGatedMLP(torch.nn.Linear(2, 2))


def test_t5_gated_mlp_keeps_the_product_compressed_and_its_forward_exact():
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    from hf_actq.ops.gated_mlp import CompressedT5GatedMLP

    torch.manual_seed(0)
    config = T5Config(d_model=64, d_ff=176, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    mlp = T5DenseGatedActDense(config)
    module = CompressedT5GatedMLP(mlp, uniform(8, stochastic=False), 4, cache=PackCache())
    x = torch.randn(3, 10, 64, requires_grad=True)
    params = list(mlp.parameters())
    with SavedTensorMeter(exclude=params) as stock:
        want = mlp(x)
    with SavedTensorMeter(exclude=params) as ours:
        got = module(x)
    assert torch.equal(got, want)
    # The projections and wo run as plain modules here (each keeps its own input exact): only
    # the product's act input, act(gate) and up ([tokens, d_ff] fp32 each) become codes.
    inter = 3 * 10 * 176
    assert stock.nbytes - ours.nbytes > 3 * inter * 4 - 2 * (inter + 3 * 10 * 8) - inter // 2
    grad = torch.randn(3, 10, 64)
    for a, b in zip(_grads(module, params, x, grad), _grads(mlp, params, x, grad)):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    with pytest.raises(ValueError, match="needs wi_0, wi_1, wo, dropout"):
        CompressedT5GatedMLP(torch.nn.Linear(2, 2))


@pytest.mark.needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("train_down", [True, False])
def test_one_kernel_takes_the_backward_with_the_gradients_of_the_composition(
    dtype, train_down, monkeypatch
):
    """As a GPU runs it (under the interpreter on CPU): the product's backward is one launch of
    ``gated_backward_kernel`` (reading the packs and the codes, writing grad_gate, grad_up and,
    for a trained down projection, its input), with the gradients of the unpacks, products and
    few-bit backward it replaces, bit for bit."""
    mlp = _mlp(dtype=dtype)
    mlp.down_proj.weight.requires_grad_(train_down)
    x = torch.randn(2, 24, 64).to(dtype)
    grad = torch.randn(2, 24, 64).to(dtype)
    params = [p for p in mlp.parameters() if p.requires_grad]
    launches = []
    kernel = KERNELS["gated_backward"]
    launcher = kernel.launcher
    monkeypatch.setattr(kernel, "launcher", lambda *a: launches.append(a[-1]) or launcher(*a))

    def gradients():
        module = CompressedGatedMLP(mlp, uniform(4), activation_bits=2, cache=PackCache())
        torch.manual_seed(0)
        with kernels_on_cpu():
            return _grads(module, params, x, grad)

    fused = gradients()
    assert launches == [train_down]  # one launch; down's input rebuilt only when trained
    monkeypatch.setattr(gated_mlp, "_one_kernel_takes", lambda *args: False)
    composed = gradients()
    assert launches == [train_down]
    for a, b in zip(fused, composed, strict=True):
        assert torch.equal(a, b)


def _lora_gradients(checkpointing: bool = False) -> dict:
    """One step's gradients of a tiny bf16 LLaMA with LoRA on every linear, "uniform", through
    the kernels' dispatch (the gated ones by the interpreter on the CPU)."""
    from peft import LoraConfig, get_peft_model

    import hf_actq
    from hf_actq import ActQConfig
    from hf_actq.testing import tiny_batch, tiny_model

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_model("llama").to(torch.bfloat16), LoraConfig(r=4, target_modules="all-linear")
    )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
    model.train()
    torch.manual_seed(1)
    # The gated kernels interpreted, every other kernel's twin (bit for bit the same, as
    # tests/kernels checks) in its place: a step through every interpreted kernel took about
    # half a minute.
    others = [kernel for name, kernel in KERNELS.items() if not name.startswith("gated_")]
    launchers = [kernel.launcher for kernel in others]
    try:
        for kernel in others:
            kernel.launcher = kernel.twin
        with kernels_on_cpu():
            model(**tiny_batch("llama")).loss.backward()
    finally:
        for kernel, launcher in zip(others, launchers, strict=True):
            kernel.launcher = launcher
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(fused: dict, composed: dict) -> None:
    assert fused.keys() == composed.keys() and len(fused) > 10
    for name in fused:
        assert torch.equal(fused[name], composed[name]), name


@pytest.mark.needs_kernels
def test_under_lora_the_kernel_reads_the_packs_down_proj_shares(monkeypatch):
    """PEFT's down_proj runs as its own module and its lora_A keeps the product rebuilt from
    act(gate)'s and up's packs, which it unpacks first in backward. The product's own backward
    still takes one kernel over the packed buffers (no dense act(gate) or up read), leaves the
    share (its unpacked tensors are freed then), and the gradients equal the composition's."""
    pytest.importorskip("peft")
    from hf_actq.codecs.packed import UnpackShare

    launches, left = [], []
    kernel = KERNELS["gated_backward"]
    launcher = kernel.launcher
    monkeypatch.setattr(kernel, "launcher", lambda *a: launches.append(1) or launcher(*a))
    leave = UnpackShare.leave
    monkeypatch.setattr(UnpackShare, "leave", lambda share: left.append(share) or leave(share))
    fused = _lora_gradients()
    assert len(launches) == 2  # one per layer
    assert len(left) == 4 and all(share.value is None for share in left)
    monkeypatch.setattr(gated_mlp, "_one_kernel_takes", lambda *args: False)
    composed = _lora_gradients()
    assert len(launches) == 2
    _assert_same(fused, composed)


@pytest.mark.needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_kernel_takes_the_forward_with_the_outputs_and_packs_of_the_composition(
    dtype, monkeypatch
):
    """Where the few-bit forward is exact (forced here, for relu, whose Triton formula the
    interpreter computes exactly): act(gate), the product, the codes and both packs in one
    launch of ``gated_forward_kernel``, with the seeds the two packs would draw, so the output,
    the packs and the gradients equal the op-by-op path's bit for bit."""
    from hf_actq.kernels import gated_product
    from hf_actq.kernels.fewbit import EXACT_OPTION_CANDIDATES

    monkeypatch.setattr(
        gated_product, "exact_forward_options", lambda *args: EXACT_OPTION_CANDIDATES[0]
    )
    launches = []
    kernel = KERNELS["gated_forward"]
    launcher = kernel.launcher
    monkeypatch.setattr(kernel, "launcher", lambda *a: launches.append(1) or launcher(*a))
    mlp = _mlp("relu", dtype)
    x = torch.randn(2, 24, 64).to(dtype)
    grad = torch.randn(2, 24, 64).to(dtype)
    params = list(mlp.parameters())

    def run():
        module = CompressedGatedMLP(mlp, uniform(4), activation_bits=1, cache=PackCache())
        torch.manual_seed(0)
        with kernels_on_cpu():
            leaf = x.detach().requires_grad_()
            y = module(leaf)
            y.backward(grad)
        return [y.detach(), leaf.grad] + [p.grad.clone() for p in params]

    fused = run()
    assert len(launches) == 1
    assert torch.equal(fused[0], mlp(x))  # the forward stays the unpatched module's
    monkeypatch.setattr(gated_mlp, "product_forward", lambda *args: None)
    for p in params:
        p.grad = None
    composed = run()
    assert len(launches) == 1
    for a, b in zip(fused, composed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.needs_kernels
def test_under_lora_and_stock_checkpointing_both_kernels_give_the_op_by_op_gradients(
    monkeypatch,
):
    """PEFT LoRA with ``gradient_checkpointing=True`` (non-reentrant): the gated forward runs in
    the forward and again in the recompute (the same seeds: checkpointing restores the RNG),
    the backward kernel reads the packs down_proj's lora_A shares, and the gradients are the
    op-by-op path's bit for bit."""
    pytest.importorskip("peft")
    from hf_actq.kernels import gated_product
    from hf_actq.kernels.fewbit import EXACT_OPTION_CANDIDATES

    monkeypatch.setattr(
        gated_product, "exact_forward_options", lambda *args: EXACT_OPTION_CANDIDATES[0]
    )
    launches = []
    for name in ("gated_forward", "gated_backward"):
        kernel = KERNELS[name]
        monkeypatch.setattr(
            kernel,
            "launcher",
            lambda *a, name=name, run=kernel.launcher: launches.append(name) or run(*a),
        )
    fused = _lora_gradients(checkpointing=True)
    # Per layer: forward, recompute, backward.
    assert sorted(launches) == ["gated_backward"] * 2 + ["gated_forward"] * 4, launches
    monkeypatch.setattr(gated_mlp, "product_forward", lambda *args: None)
    monkeypatch.setattr(gated_mlp, "_one_kernel_takes", lambda *args: False)
    composed = _lora_gradients(checkpointing=True)
    assert len(launches) == 6
    _assert_same(fused, composed)


@pytest.mark.needs_kernels
def test_phi3s_fused_projection_runs_the_forward_kernel_on_its_halves(monkeypatch):
    """Phi-3's ``gate, up = gate_up_proj(x).chunk(2)``: the forward kernel reads both halves in
    place (one launch) and the output and gradients equal the op-by-op path's bit for bit."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    from hf_actq.kernels import gated_product
    from hf_actq.kernels.fewbit import EXACT_OPTION_CANDIDATES
    from hf_actq.ops.gated_mlp import CompressedFusedGatedMLP

    monkeypatch.setattr(
        gated_product, "exact_forward_options", lambda *args: EXACT_OPTION_CANDIDATES[0]
    )
    torch.manual_seed(0)
    config = Phi3Config(hidden_size=64, intermediate_size=176, hidden_act="relu")
    mlp = Phi3MLP(config).to(torch.bfloat16)
    x = torch.randn(2, 24, 64).to(torch.bfloat16)
    grad = torch.randn(2, 24, 64).to(torch.bfloat16)
    launches = []
    kernel = KERNELS["gated_forward"]
    launcher = kernel.launcher
    monkeypatch.setattr(kernel, "launcher", lambda *a: launches.append(1) or launcher(*a))

    def run():
        module = CompressedFusedGatedMLP(mlp, uniform(4), activation_bits=1, cache=PackCache())
        mlp.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with kernels_on_cpu():
            leaf = x.detach().requires_grad_()
            y = module(leaf)
            y.backward(grad)
        return [y.detach(), leaf.grad] + [p.grad.clone() for p in mlp.parameters()]

    fused = run()
    assert len(launches) == 1
    assert torch.equal(fused[0], mlp(x))  # the forward stays the unpatched module's
    monkeypatch.setattr(gated_mlp, "product_forward", lambda *args: None)
    composed = run()
    assert len(launches) == 1
    for a, b in zip(fused, composed, strict=True):
        assert torch.equal(a, b)
