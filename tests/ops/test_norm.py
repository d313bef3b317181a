import copy

import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

import hf_actq
from hf_actq import SavedTensorMeter
from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.codecs.packed import ExactCodec
from hf_actq.kernels import kernels_on_cpu
from hf_actq.kernels.packing import CHUNK_ELEMENTS
from hf_actq.kernels.registry import KERNELS
from hf_actq.memory.peak import PeakMemory
from hf_actq.ops.dedup import PackCache, _where
from hf_actq.ops.norm import CompressedLayerNorm, CompressedRMSNorm
from hf_actq.ops.state import state_of


def _grads(module, params, x, grad):
    x = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    module(x).backward(grad)
    return [x.grad] + [p.grad.clone() for p in params]


def _layer_norm(width, affine=True):
    torch.manual_seed(0)
    norm = nn.LayerNorm(width, elementwise_affine=affine)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_exact_forward_close_gradients_small_memory(dtype):
    norm = _layer_norm(96).to(dtype)
    codec = uniform(8, stochastic=False)
    module = CompressedLayerNorm(norm, codec, PackCache())
    x = (torch.randn(6, 20, 96) * 3 + 1).to(dtype).requires_grad_()
    with SavedTensorMeter(exclude=list(norm.parameters())) as meter:
        y = module(x)
    assert torch.equal(y, norm(x))
    # codes and scales of x_hat, plus one fp32 rstd per row
    assert meter.nbytes == codec.nbytes(x.shape) + 6 * 20 * 4
    grad = torch.randn(x.shape).to(dtype)
    params = list(norm.parameters())
    ours = _grads(module, params, x, grad)
    exact = _grads(norm.float(), list(norm.parameters()), x.float(), grad.float())
    norm.to(dtype)
    for got, want in zip(ours, exact):
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 0.02 * scale


def test_layer_norm_without_affine():
    norm = _layer_norm(32, affine=False)
    module = CompressedLayerNorm(norm, uniform(8, stochastic=False), PackCache())
    x = torch.randn(10, 32, requires_grad=True)
    grad = torch.randn(10, 32)
    ours = _grads(module, [], x, grad)[0]
    exact = _grads(norm, [], x, grad)[0]
    assert (ours - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "form", [LlamaRMSNorm, Gemma3RMSNorm, Olmo2RMSNorm], ids=lambda c: c.__name__
)
def test_rms_norm(dtype, form):
    # LLaMA's w * x_hat cast first, Gemma's (1 + w) * x_hat and OLMo-2's (gpt-oss's) w * x_hat
    # in fp32, then cast: each bit for bit.
    torch.manual_seed(0)
    norm = form(64, eps=1e-6)
    nn.init.normal_(norm.weight)
    norm = norm.to(dtype)
    codec = uniform(8, stochastic=False)
    module = CompressedRMSNorm(norm, codec, PackCache())
    x = (torch.randn(4, 16, 64) * 2).to(dtype).requires_grad_()
    with SavedTensorMeter(exclude=[norm.weight]) as meter:
        y = module(x)
    assert torch.equal(y, norm(x))
    assert meter.nbytes == codec.nbytes(x.shape) + 4 * 16 * 4
    grad = torch.randn(x.shape).to(dtype)
    ours = _grads(module, [norm.weight], x, grad)
    exact = _grads(norm.float(), [norm.weight], x.float(), grad.float())
    for got, want in zip(ours, exact):
        assert (got.float() - want).abs().max().item() <= 0.02 * want.abs().max().item()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "gemma_rms_norm"])
def test_norms_work_in_row_chunks_without_full_size_fp32_copies(kind):
    """A bf16 input three chunks and a bit long: the forward is still the stock module's bit for
    bit, exact codes give the stock gradients, and no allocation in forward or backward is larger
    than the input itself (a full-size fp32 copy would be twice as large)."""
    width = 1024
    rows = 3 * CHUNK_ELEMENTS // width + 5
    torch.manual_seed(0)
    if kind == "layer_norm":
        norm = _layer_norm(width).to(torch.bfloat16)
        module = CompressedLayerNorm(norm, ExactCodec(), PackCache())
    else:
        norm = (LlamaRMSNorm if kind == "rms_norm" else Gemma3RMSNorm)(width, eps=1e-6)
        nn.init.normal_(norm.weight)
        norm = norm.to(torch.bfloat16)
        module = CompressedRMSNorm(norm, ExactCodec(), PackCache())
    x = (torch.randn(rows, width) * 2 + 0.5).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(rows, width).to(torch.bfloat16)
    input_bytes = x.numel() * x.element_size()
    with PeakMemory("cpu") as forward:
        y = module(x)
    with PeakMemory("cpu") as backward:
        y.backward(grad)
    assert forward.largest_bytes <= input_bytes and backward.largest_bytes <= input_bytes
    assert torch.equal(y, norm(x))
    ours = [x.grad] + [p.grad.clone() for p in norm.parameters()]
    exact_grads = _grads(norm.float(), list(norm.parameters()), x.float(), grad.float())
    for got, want in zip(ours, exact_grads):
        # bf16 rounding of the input gradient; fp32 sums over 12k rows for the parameters
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())


def test_invalid_wrapping():
    with pytest.raises(ValueError, match="wraps an nn.LayerNorm over the last dimension"):
        CompressedLayerNorm(nn.LayerNorm((4, 4)))
    with pytest.raises(ValueError, match="needs a module with weight and variance_epsilon"):
        CompressedRMSNorm(nn.Linear(2, 2))


def _norm_of(kind, width, dtype):
    if kind == "layer":
        norm = nn.LayerNorm(width).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        return norm
    if kind == "gemma":  # scales by 1 + w, near 1 as trained Gemma weights are near 0
        norm = Gemma3RMSNorm(width).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(-0.5, 0.5)
        return norm
    norm = LlamaRMSNorm(width).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def _next_layer_grads(module, x, *params):
    y = module(x)
    # What the next layer does with it: a linear that keeps its input (y itself).
    head = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)
    loss = (y * head).sum() + (y.float() ** 2).sum()
    return y, torch.autograd.grad(loss, (x, *params))


@pytest.mark.parametrize("kind", ["layer", "rms", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_sharing_norms_keep_their_output_and_rebuild_the_input(kind, dtype):
    norm = _norm_of(kind, 64, dtype)
    params = [p for p in norm.parameters()]
    x = (3 * torch.randn(4, 8, 64) + 1).to(dtype).requires_grad_()
    stock_y, stock_grads = _next_layer_grads(norm, x, *params)
    cls = CompressedLayerNorm if kind == "layer" else CompressedRMSNorm
    shared = cls(norm, codec=None, share_output=True)
    with SavedTensorMeter(exclude=params) as meter:
        y = shared(x)
    # The output itself (which the next layer keeps: no bytes of its own), fp32 rstd per row,
    # and the guard columns of x_hat with their indices.
    rows = x.numel() // 64
    guard = rows * y.element_size() + 8  # one guard column and its index
    assert meter.nbytes == y.numel() * y.element_size() + rows * 4 + guard
    y, grads = _next_layer_grads(shared, x, *params)
    assert torch.equal(y, stock_y)
    # fp32: rounding only; bf16: x_hat is rebuilt from the bf16 output (about one bf16 ulp).
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(grads, stock_grads):
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < tolerance, error


@pytest.mark.parametrize("kind", ["layer", "rms", "gemma"])
def test_memory_sharing_norm_whose_weight_turns_zero_in_training_stays_exact(kind):
    """A zero that appears after patching (an optimizer step): y / w is undefined there, so the
    column of the smallest |w| keeps its x_hat beside y, chosen on the device (no check that
    waits for the GPU)."""
    from hf_actq.ops.norm import GUARD_COLUMNS

    norm = _norm_of(kind, 32, torch.float32)
    x = (3 * torch.randn(6, 32) + 1).requires_grad_()
    cls = CompressedLayerNorm if kind == "layer" else CompressedRMSNorm
    shared = cls(norm, codec=None, share_output=True)
    with torch.no_grad():
        norm.weight[17] = 0.0 if kind != "gemma" else -1.0
    params = list(norm.parameters())
    stock_y, stock_grads = _next_layer_grads(norm, x, *params)
    with SavedTensorMeter(exclude=params) as meter:
        y = shared(x)
    # y (the next layer's), rstd, and x_hat's guard column with its index.
    assert GUARD_COLUMNS == 1
    assert meter.nbytes == y.numel() * 4 + 6 * 4 + 6 * 4 + 8
    y, grads = _next_layer_grads(shared, x, *params)
    assert torch.equal(y, stock_y)
    for got, want in zip(grads, stock_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rms", "gemma"])
def test_memory_sharing_norm_patched_with_a_zero_weight_keeps_the_input(kind):
    """More zeros than guard columns when patched (a zero-initialised norm): x_hat is kept."""
    norm = _norm_of(kind, 32, torch.float32)
    with torch.no_grad():
        norm.weight.fill_(0.0 if kind == "rms" else -1.0)
    x = torch.randn(6, 32, requires_grad=True)
    shared = CompressedRMSNorm(norm, codec=ExactCodec(), share_output=True)
    stock_y, stock_grads = _next_layer_grads(norm, x, norm.weight)
    with SavedTensorMeter(exclude=[norm.weight]) as meter:
        shared(x)
    # x_hat packed by the (exact) codec and rstd, as without memory sharing.
    assert meter.nbytes == x.numel() * 4 + 6 * 4
    y, grads = _next_layer_grads(shared, x, norm.weight)
    assert torch.equal(y, stock_y)
    for got, want in zip(grads, stock_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["layer", "rms", "gemma"])
def test_compressed_norm_offers_its_output_to_the_next_linear(kind):
    # The next linear (same codec, same cache) takes the norm's output as rebuilt from the norm's
    # packed x_hat: w * x_hat (+ b), with no second packed copy of its own.
    from hf_actq.ops.linear import CompressedLinear
    from hf_actq.ops.norm import NormOutputPacked

    codec = uniform(4, stochastic=False)
    norm = _norm_of(kind, 64, torch.float32)
    linear = nn.Linear(64, 32)
    params = [*norm.parameters(), *linear.parameters()]
    x = (3 * torch.randn(4, 8, 64) + 1).requires_grad_()
    nbytes = {}
    for offer in (False, True):
        cache = PackCache()
        cls = CompressedLayerNorm if kind == "layer" else CompressedRMSNorm
        patched_norm = cls(norm, codec=codec, cache=cache)
        state_of(patched_norm).offer_output = offer
        patched_linear = CompressedLinear(linear, codec=codec, cache=cache)
        with SavedTensorMeter(exclude=params) as meter:
            y = patched_norm(x)
            out = patched_linear(y)
        nbytes[offer] = meter.nbytes
    # One packed copy fewer; the norm saves copies of its weight and bias (which the rebuilt
    # form shares) instead of the parameters, which the meter leaves out.
    params_bytes = sum(p.numel() * p.element_size() for p in norm.parameters())
    assert nbytes[False] - nbytes[True] == codec.nbytes(y.shape) - params_bytes
    # What the linear rebuilds is the norm's output from its packed x_hat.
    entry = cache._entries[_where(y)]
    rebuilt = entry.reuse(y, codec)
    assert isinstance(rebuilt, NormOutputPacked)
    x_hat = rebuilt.source.with_tensors(rebuilt.tensors[: rebuilt._split]).unpack()
    want = {
        "rms": lambda: norm.weight * x_hat,
        "gemma": lambda: x_hat * (1 + norm.weight),
        "layer": lambda: x_hat * norm.weight + norm.bias,
    }[kind]()
    torch.testing.assert_close(rebuilt.unpack(), want.detach())
    assert (rebuilt.unpack() - y).abs().max() < 0.2 * y.abs().max()  # 4-bit rounding of x_hat
    out.sum().backward()  # backward runs through the shared buffers
    assert linear.weight.grad is not None and x.grad is not None


def _launch_counter(monkeypatch, *names):
    """``{name: launches}`` of the kernel ops ``names``, counted from now on."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        kernel = KERNELS[name]

        def counted(*args, name=name, launcher=kernel.launcher):
            counts[name] += 1
            return launcher(*args)

        monkeypatch.setattr(kernel, "launcher", counted)
    return counts


def _kernel_norm_cases():
    """Every pair of norm kind, dtype and codec in the default run (6 cases), the other 6 of
    the 12 combinations slow (3.6 s each under the interpreter)."""
    codecs = {"uniform": uniform(4), "aq": AverageQuantCodec(2, 4, 64)}
    for k, kind in enumerate(("layer", "rms", "gemma")):
        for d, dtype in enumerate((torch.float32, torch.bfloat16)):
            for c, (name, codec) in enumerate(codecs.items()):
                marks = () if (k + d + c) % 2 == 0 else pytest.mark.slow
                yield pytest.param(kind, dtype, codec, marks=marks, id=f"{name}-{dtype}-{kind}")


@pytest.mark.needs_kernels
@pytest.mark.parametrize("kind,dtype,codec", list(_kernel_norm_cases()))
def test_one_kernel_packs_the_normalized_input_and_backward_reads_the_pack(
    kind, dtype, codec, monkeypatch
):
    """Forward: ``x_hat`` (and an RMSNorm's output) from one ``norm_pack`` launch, from the
    statistics PyTorch computed, with the seed the composition's pack would draw; backward:
    ``norm_backward_packed`` dequantizes x_hat inside its kernels. The output stays the
    unpatched module's, and output, saved bytes and gradients equal the composition's (x_hat
    computed, packed, unpacked, then the backward kernels) bit for bit."""
    from hf_actq.ops import norm as norm_ops

    torch.manual_seed(0)
    norm = _norm_of(kind, 72, dtype)
    counts = _launch_counter(monkeypatch, "norm_pack", "norm_backward_packed", "aq_quantize")
    # 5 x 19 rows of 72: tiles of 4096 elements end mid-row, and the last one is partial.
    x = (torch.randn(5, 19, 72) * 3 + 1).to(dtype)
    grad = torch.randn(x.shape).to(dtype)
    params = list(norm.parameters())
    wrapper = CompressedLayerNorm if kind == "layer" else CompressedRMSNorm

    def run():
        module = wrapper(norm, codec, PackCache())
        torch.manual_seed(1)
        with kernels_on_cpu():
            leaf = x.detach().requires_grad_()
            with SavedTensorMeter(exclude=params) as meter:
                y = module(leaf)
            for p in params:
                p.grad = None
            y.backward(grad)
        return [y.detach(), leaf.grad] + [p.grad.clone() for p in params], meter.nbytes

    fused, fused_bytes = run()
    assert counts == {"norm_pack": 1, "norm_backward_packed": 1, "aq_quantize": 0}
    with torch.no_grad():
        assert torch.equal(fused[0], norm(x))
    monkeypatch.setattr(norm_ops, "_kernel_codec", lambda *args: None)
    monkeypatch.setattr(norm_ops, "_dequantized_in_kernel", lambda *args: False)
    composed, composed_bytes = run()
    assert counts == {"norm_pack": 1, "norm_backward_packed": 1, "aq_quantize": 1}
    assert fused_bytes == composed_bytes
    for a, b in zip(fused, composed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.needs_kernels
@pytest.mark.parametrize("kind", ["layer", "rms", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_memory_sharing_norms_backward_rebuilds_x_hat_inside_its_kernels(
    kind, dtype, monkeypatch
):
    """The backward of a norm that kept its output is one ``norm_backward_from_output`` call:
    x_hat rebuilt from y (and the guard column, here where a trained weight turned zero) inside
    the backward kernels, where the twin makes a full-size x_hat op by op. The gradients are the
    twin's up to summation order, and the stock module's up to y's rounding."""
    from hf_actq.kernels import norm as norm_kernels

    norm = _norm_of(kind, 1100, dtype)  # two column tiles of the backward kernels
    with torch.no_grad():
        norm.weight[1050] = 0.0 if kind != "gemma" else -1.0
    counts = _launch_counter(monkeypatch, "norm_backward_from_output", "norm_backward")
    rebuilt = []
    twin = norm_kernels.x_hat_from_output
    monkeypatch.setattr(norm_kernels, "x_hat_from_output", lambda *a: rebuilt.append(1) or twin(*a))
    x = (3 * torch.randn(3, 5, 1100) + 1).to(dtype)
    grad = torch.randn(x.shape).to(dtype)
    params = list(norm.parameters())
    shared = (CompressedLayerNorm if kind == "layer" else CompressedRMSNorm)(
        norm, codec=None, share_output=True
    )
    with kernels_on_cpu():
        fused = _grads(shared, params, x, grad)
    assert counts == {"norm_backward_from_output": 1, "norm_backward": 0} and not rebuilt
    composed = _grads(shared, params, x, grad)  # the twin
    assert rebuilt == [1]
    stock = _grads(norm, params, x, grad)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(fused[0], composed[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(fused[1:], composed[1:], strict=True):  # fp32 sums, cast to the weight's
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance)
    for got, want in zip(fused, stock, strict=True):
        assert torch.isfinite(got).all()
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < (1e-5 if dtype == torch.float32 else 2e-2), error


@pytest.mark.needs_kernels
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_the_norm_backward_takes_x_hat_its_output_consumer_unpacked(kind, monkeypatch):
    """The next linear takes the norm's output rebuilt from the norm's packed x_hat and, running
    its backward first, unpacks x_hat once for both: the norm's backward then reads that tensor
    (no second dequantization, in or out of its kernel). Without the consumer it dequantizes
    inside its kernel. Gradients equal the composition's bit for bit either way."""
    from hf_actq.ops import norm as norm_ops
    from hf_actq.ops.linear import CompressedLinear

    torch.manual_seed(0)
    codec = uniform(4)
    norm = _norm_of(kind, 64, torch.bfloat16)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    params = [*norm.parameters(), *linear.parameters()]
    x = (3 * torch.randn(4, 8, 64) + 1).to(torch.bfloat16)
    counts = _launch_counter(monkeypatch, "norm_backward_packed", "aq_dequantize")

    def run(with_linear):
        cache = PackCache()
        cls = CompressedLayerNorm if kind == "layer" else CompressedRMSNorm
        patched_norm = cls(norm, codec=codec, cache=cache)
        state_of(patched_norm).offer_output = True
        patched_linear = CompressedLinear(linear, codec=codec, cache=cache)
        for p in params:
            p.grad = None
        torch.manual_seed(1)
        with kernels_on_cpu():
            leaf = x.detach().requires_grad_()
            y = patched_norm(leaf)
            (patched_linear(y) if with_linear else y).float().square().sum().backward()
        return [leaf.grad] + [p.grad.clone() for p in params if p.grad is not None]

    shared = run(with_linear=True)
    assert counts == {"norm_backward_packed": 0, "aq_dequantize": 1}
    alone = run(with_linear=False)
    assert counts == {"norm_backward_packed": 1, "aq_dequantize": 1}
    monkeypatch.setattr(norm_ops, "_dequantized_in_kernel", lambda *args: False)
    for fused, with_linear in ((shared, True), (alone, False)):
        composed = run(with_linear)
        for a, b in zip(fused, composed, strict=True):
            assert torch.equal(a, b)


def test_fp32_scaled_norm_offers_its_output_in_its_own_form():
    # OLMo-2's and gpt-oss's RMSNorm scales by w in fp32 before the cast (in bf16 not LLaMA's
    # form, which casts x_hat first): the forward is that form's, bit for bit, and the output
    # the next linear rebuilds is w times the packed x_hat, in fp32, cast.
    from hf_actq.ops.linear import CompressedLinear

    codec = uniform(8, stochastic=False)
    torch.manual_seed(0)
    norm = Olmo2RMSNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm, linear = norm.to(torch.bfloat16), nn.Linear(64, 32).to(torch.bfloat16)
    cache = PackCache()
    patched_norm = CompressedRMSNorm(norm, codec=codec, cache=cache)
    assert (state_of(patched_norm).norm_offset, state_of(patched_norm).norm_fp32_scale) == (
        0.0,
        True,
    )
    state_of(patched_norm).offer_output = True
    x = (3 * torch.randn(4, 8, 64) + 1).to(torch.bfloat16).requires_grad_()
    y = patched_norm(x)
    assert torch.equal(y, norm(x))
    CompressedLinear(linear, codec=codec, cache=cache)(y)
    rebuilt = cache._entries[_where(y)].reuse(y, codec)
    x_hat = rebuilt.source.with_tensors(rebuilt.tensors[: rebuilt._split]).unpack()
    want = (x_hat.float() * norm.weight.float()).to(torch.bfloat16)
    assert torch.equal(rebuilt.unpack(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_scale_free_rms_norm_keeps_its_input_packed(dtype, caplog):
    """Gemma 4's v_norm has no weight: ``(x * rsqrt(mean(x^2) + eps)).to(dtype)``, LLaMA's form
    without w, found by the layer rules and checked bit for bit in each float dtype. It kept an
    fp32 copy of its input; now x_hat's pack and an fp32 rstd per row."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    import hf_actq

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(64, 64), Gemma4RMSNorm(64, with_scale=False)).to(dtype)
    model = copy.deepcopy(stock)
    codec = uniform(8)
    config = hf_actq.ActQConfig.from_recipe("uniform", bits=8, linear=False)
    handle = hf_actq.apply(model, config)
    assert handle.patched["1"].startswith("norm ")
    x = (torch.randn(4, 16, 64) * 2).to(dtype).requires_grad_()
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        y = model[1](x)
    assert torch.equal(y, stock[1](x))
    assert meter.nbytes == codec.nbytes(x.shape) + 4 * 16 * 4
    grad = torch.randn(x.shape).to(dtype)
    ours = torch.autograd.grad(model(x), x, grad)[0]
    with kernels_on_cpu():  # the backward kernel reading x_hat's pack, with no weight
        kernel = torch.autograd.grad(model(x), x, grad)[0]
    exact = torch.autograd.grad(stock.float()(x.float()), x, grad.float())[0]
    for got in (ours, kernel):
        assert (got.float() - exact).abs().max().item() <= 0.02 * exact.abs().max().item()


def test_a_scale_free_rms_norm_shares_its_output_under_fewbit():
    # Exact, keeping its output (which the next layer keeps) and rebuilding x_hat from it.
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(64, 64), Gemma4RMSNorm(64, with_scale=False))
    model = copy.deepcopy(stock)
    handle = hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("fewbit"))
    assert "keeps its output" in handle.patched["1"]
    x = (torch.randn(4, 16, 64) * 2).requires_grad_()
    stock_y, stock_grads = _next_layer_grads(stock[1], x)
    y, grads = _next_layer_grads(model[1], x)
    assert torch.equal(y, stock_y)
    torch.testing.assert_close(grads[0], stock_grads[0], rtol=1e-5, atol=1e-6)


def test_a_scale_free_rms_norm_compiles_without_a_break():
    # Its form is checked in each float dtype when patched: no check (a random input, an
    # equality) runs inside a trace, where it broke the graph at every such norm.
    model = nn.Sequential(nn.Linear(64, 64), Gemma4RMSNorm(64, with_scale=False))
    hf_actq.apply(model, hf_actq.ActQConfig.from_recipe("uniform", bits=8, linear=False))
    x = torch.randn(4, 64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))
