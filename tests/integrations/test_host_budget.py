"""What each pack, unpack, compressed op and training step asks of the host, counted on the CPU
with the Triton kernels stubbed (``hf_actq.testing.host_budget``): deterministic counts, not
timings. On a GPU each launch costs the host several microseconds and each read of a device value
(``.item()``, ``bool(tensor)``) waits for the device; the first H200 run found a MiniLM-sized
step bound by exactly these (gpu-speed-review.md, section 3)."""

import pytest
import torch
from torch import nn

import hf_actq
from hf_actq import ActQConfig
from hf_actq.codecs import AverageQuantCodec, MaskCodec, SignPreservingCodec, SmaQCodec
from hf_actq.codecs.rotated import RotatedSampleCodec
from hf_actq.ops import FewBitActivation
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.linear import CompressedLinear
from hf_actq.testing import host_budget, stock_checkpointing, tiny_batch, tiny_model

pytest.importorskip("triton")

CODECS = {
    "uniform 4-bit": AverageQuantCodec(4, 1),
    "uniform 3-bit": AverageQuantCodec(3, 1, block_size=64),
    "AQ 0.5-bit": AverageQuantCodec(2, 4),
    "BLPA 4-bit": SignPreservingCodec(4),
    "mask": MaskCodec(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CODECS))
def test_a_pack_and_an_unpack_are_one_launch_and_one_allocation_each(name, dtype):
    codec = CODECS[name]
    x = torch.randn(96, 512).to(dtype)
    with host_budget() as pack:
        packed = codec.pack(x)
    with host_budget() as unpack:
        codec.unpack(packed)
    for budget in (pack, unpack):
        assert sum(budget.triton_launches.values()) == 1, budget
        assert budget.device_ops == 0 and budget.allocations == 1, budget
        assert budget.host_reads == 0, budget
    # Stochastic rounding still draws its seed on the host (not a device read).
    assert pack.seeds == int(codec.uses_rng)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rotated_pack_and_unpack_are_one_launch_and_one_allocation_each(dtype):
    """The rotated codec with every coefficient kept ("checkpoint"'s layer inputs): the rotation
    runs inside the pack and unpack kernels (a matrix product into full-size coefficients
    before, then AQ's kernel: two allocations a pack)."""
    codec = RotatedSampleCodec(bits=4, group_size=1)
    x = torch.randn(96, 512).to(dtype)
    codec.unpack(codec.pack(x))  # the rotation matrix, made once per device and dtype
    with host_budget() as pack:
        packed = codec.pack(x)
    with host_budget() as unpack:
        codec.unpack(packed)
    assert pack.triton_launches == {"rotated_quantize_kernel": 1}, pack
    assert unpack.triton_launches == {"rotated_dequantize_kernel": 1}, unpack
    for budget in (pack, unpack):
        assert budget.device_ops == 0 and budget.allocations == 1, budget
        assert budget.host_reads == 0, budget
    assert pack.seeds == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "codec,kernel",
    [
        (AverageQuantCodec(4, 1), "aq_quantize_strided_kernel"),
        (SignPreservingCodec(4), "blpa_quantize_strided_kernel"),
    ],
    ids=["uniform", "blpa"],
)
def test_a_transposed_view_packs_in_one_launch_without_a_copy(codec, kernel, dtype):
    """Attention's q, k and v ([batch, heads, seq, dim] views of [batch, seq, heads, dim]): the
    pack kernel reads them where they lie; ``reshape(-1)`` copied each one first."""
    q = torch.randn(2, 64, 4, 32).to(dtype).transpose(1, 2)
    with host_budget() as pack:
        packed = codec.pack(q)
    assert pack.triton_launches == {kernel: 1}, pack
    assert pack.device_ops == 0 and pack.allocations == 1 and pack.host_reads == 0, pack
    assert packed.shape == q.shape


@pytest.mark.parametrize(
    "transposed,kernels",
    [
        (False, ("smaq_stats_kernel", "smaq_quantize_kernel")),
        (True, ("smaq_stats_strided_kernel", "smaq_quantize_strided_kernel")),
    ],
    ids=["flat", "transposed q"],
)
def test_a_smaq_pack_is_three_launches_into_one_allocation(transposed, kernels):
    """SmaQ's statistics (one read of the tensor, then one program combining the tiles'
    partials: a dozen small PyTorch ops before) and its quantize kernel, into one allocation
    kept (codes, slots, statistics) and one transient (the partials); attention's transposed q
    not copied first."""
    codec = SmaQCodec()
    x = torch.randn(2, 128, 4, 32).to(torch.bfloat16)
    x = x.transpose(1, 2) if transposed else x.view(-1)[5:]  # a partial last tile
    with host_budget() as pack:
        packed = codec.pack(x)
    stats, quantize = kernels
    assert pack.triton_launches == {stats: 1, "smaq_combine_kernel": 1, quantize: 1}, pack
    assert pack.device_ops == 0 and pack.host_reads == 0 and pack.allocations == 2, pack
    assert len({t.untyped_storage().data_ptr() for t in packed.tensors}) == 1


def _fwd_bwd(module, x):
    module(x).sum().backward()  # the first call compiles nothing but warms the caches
    with host_budget() as budget:
        module(x).sum().backward()
    return budget


def test_a_compressed_linear_launches_its_pack_and_unpack_beside_the_stock_ops():
    x = torch.randn(64, 256, requires_grad=True)
    linear = nn.Linear(256, 128)
    stock = _fwd_bwd(linear, x)
    ours = _fwd_bwd(CompressedLinear(linear, codec=AverageQuantCodec(4, 1), cache=PackCache()), x)
    assert ours.triton_launches == {"aq_quantize_kernel": 1, "aq_dequantize_kernel": 1}
    assert ours.device_ops <= stock.device_ops
    assert ours.allocations <= stock.allocations + 2  # the packed buffer, the unpacked input
    assert ours.host_reads == stock.host_reads == 0


def test_a_few_bit_activation_is_one_launch_each_way():
    x = torch.randn(64, 256, requires_grad=True)
    stock = _fwd_bwd(nn.GELU(), x)
    ours = _fwd_bwd(FewBitActivation("gelu", bits=3), x)
    assert ours.triton_launches == {"fewbit_forward_kernel": 1, "fewbit_backward_kernel": 1}
    # One kernel writes the output and the codes (where its probe found the output exact, as
    # stubbed_kernels has it): beside the kernels, the NaN flag's memset in place of the stock
    # module's GELU.
    assert ours.device_ops <= stock.device_ops
    assert ours.host_reads == 0


def test_where_the_fused_forward_is_not_exact_pytorch_adds_one_op(monkeypatch):
    from hf_actq.kernels import fewbit

    x = torch.randn(64, 256, requires_grad=True)
    stock = _fwd_bwd(nn.GELU(), x)
    monkeypatch.setattr(fewbit, "FUSED_ACTIVATIONS", frozenset())
    ours = _fwd_bwd(FewBitActivation("gelu", bits=3), x)
    assert ours.triton_launches == {"fewbit_forward_kernel": 1, "fewbit_backward_kernel": 1}
    assert ours.device_ops <= stock.device_ops + 1  # torch's GELU beside the codes kernel
    assert ours.host_reads == 0


def test_a_gated_mlp_takes_its_product_backward_in_one_launch():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hf_actq.ops.gated_mlp import CompressedGatedMLP

    config = LlamaConfig(hidden_size=64, intermediate_size=176, hidden_act="silu")
    mlp = LlamaMLP(config).to(torch.bfloat16)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    ours = _fwd_bwd(CompressedGatedMLP(mlp, AverageQuantCodec(4, 1), cache=PackCache()), x)
    # x packed once for gate and up; act(gate), its codes, the product and the packs of
    # act(gate) and up in one kernel; backward: one kernel for the product, x unpacked once
    # for both weight gradients.
    assert ours.triton_launches == {
        "aq_quantize_kernel": 1,
        "gated_forward_kernel": 1,
        "gated_backward_kernel": 1,
        "aq_dequantize_kernel": 1,
    }
    assert ours.host_reads == 0


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_a_compressed_norm_is_one_launch_forward_and_two_backward(kind):
    """x_hat normalized and packed by one kernel from PyTorch's statistics (an RMSNorm's output
    too); backward dequantizes it inside its two kernels (the row means, then the gradients)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_actq.ops.norm import CompressedLayerNorm, CompressedRMSNorm

    x = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    if kind == "layer_norm":
        norm = nn.LayerNorm(64).to(torch.bfloat16)
        patched = CompressedLayerNorm(norm, AverageQuantCodec(4, 1), cache=PackCache())
    else:
        norm = LlamaRMSNorm(64).to(torch.bfloat16)
        patched = CompressedRMSNorm(norm, AverageQuantCodec(4, 1), cache=PackCache())
    stock = _fwd_bwd(norm, x)
    ours = _fwd_bwd(patched, x)
    assert ours.triton_launches == {
        "norm_pack_kernel": 1,
        "norm_row_means_kernel": 1,
        "norm_backward_kernel": 1,
    }
    # LLaMA's RMSNorm makes fp32 temporaries op by op; a LayerNorm's stock step is 8 ops, ours
    # adds the partial sums' reduction and the gradients' casts, and on the CPU (not CUDA,
    # whose statistics are fp32 already) the half-precision statistics recomputed in fp32 (4
    # ops). The kernels read the weight in its own dtype (no fp32 copy).
    assert ours.device_ops <= stock.device_ops + (6 if kind == "layer_norm" else 0)
    assert ours.host_reads == stock.host_reads == 0


def _step_budget(model, batch, config=None, checkpointing=False):
    if config is not None:
        hf_actq.apply(model, config)
    if checkpointing:
        stock_checkpointing(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step():
        model(**batch).loss.backward()
        optimizer.step()  # a new weight version: what made every trained exact norm sync
        optimizer.zero_grad()

    step()
    with host_budget() as budget:
        step()
    return budget


# A training step's launches beyond the unpatched step's: Triton kernels, and other device ops
# (bounds from the counts of 2026-12-06, after the fused norms; a change that adds launches must
# raise them knowingly).
STEP_BUDGETS = {
    # model, recipe: (Triton launches, extra device ops); counted: 14/14 (14/39 before the
    # memory-sharing norms rebuilt x_hat inside their backward kernels, 14/19 before their
    # guard skipped adding a zero offset), 47/15, 11/3, 12/-29 (12/-5, then -25), 69/18 (96 quantize and dequantize launches before LoRA's adapters shared
    # their input, 87 before each pack was unpacked once, 78 before down_proj's lora_A took the
    # product, 74/50 before the gated product and the few-bit forward were one kernel each, 70/38
    # before the norms packed x_hat in one kernel and read it in their backward's), 7/58
    ("bert", "fewbit"): (14, 16),
    ("bert", "uniform"): (47, 18),
    ("bert", "checkpoint"): (11, 5),
    ("llama-lora", "fewbit"): (12, -27),
    ("llama-lora", "uniform"): (69, 21),
    ("llama-lora", "checkpoint"): (7, 62),
}


def _model(name):
    if name == "bert":
        return tiny_model("bert"), tiny_batch("bert")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tiny_model("llama").to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")), tiny_batch("llama")


@pytest.mark.parametrize("model_name,recipe", list(STEP_BUDGETS))
def test_a_patched_training_step_reads_nothing_from_the_device(model_name, recipe):
    """No ``.item()`` or ``bool(tensor)`` of ours in a step: the host never waits for the GPU
    (the unpatched step's reads are the optimizer's CPU step counters and transformers' own), and
    the launches stay within their budget."""
    checkpointing = recipe == "checkpoint"  # against stock checkpointing, which it replaces
    stock = _step_budget(*_model(model_name), checkpointing=checkpointing)
    model, batch = _model(model_name)
    ours = _step_budget(model, batch, ActQConfig.from_recipe(recipe))
    assert ours.host_reads == stock.host_reads, (ours, stock)
    triton_budget, extra_ops = STEP_BUDGETS[model_name, recipe]
    assert sum(ours.triton_launches.values()) <= triton_budget, ours.triton_launches
    assert ours.device_ops <= stock.device_ops + extra_ops, (ours.device_ops, stock.device_ops)


@pytest.mark.parametrize("recipe", ["uniform", "checkpoint"])
def test_a_compiled_patched_step_reads_no_seed_on_the_host(recipe):
    """Under torch.compile the packs take their seeds as tensors on the model's device (the
    step seed mixed per sharing group), and the codec kernels read them there: no host read in
    the step, so "reduce-overhead" can capture it in a CUDA graph whose replays advance the
    step seed and round with fresh noise. Before, each stochastic pack read its seed on the
    host (``seed.item()`` in ``hf_actq::pack``): a sync where the seed is on a GPU, a value
    frozen at capture where it is on the CPU."""
    from hf_actq.ops import dedup

    torch._dynamo.reset()
    model, batch = tiny_model("bert", num_hidden_layers=1), tiny_batch("bert")
    hf_actq.apply(model, ActQConfig.from_recipe(recipe))
    model.train()
    compiled = torch.compile(model, backend="aot_eager")
    with host_budget() as first:  # traces: the kernels and the device seeds as a GPU has them
        compiled(**batch).loss.backward()
    seed = dedup.step_seed().clone()
    with host_budget() as budget:
        compiled(**batch).loss.backward()
    assert first.triton_launches["aq_quantize_kernel"] > 0, first
    assert budget.triton_launches == first.triton_launches, (budget, first)
    assert budget.host_reads == 0, budget
    assert budget.seeds == 0  # none drawn on the host
    assert dedup.step_seed() == seed + 1  # advanced inside the compiled forward


@pytest.mark.parametrize("model_name", ["bert", "llama-lora"])
def test_each_pack_is_unpacked_once_a_step_with_the_gradients_of_one_unpack_per_op(
    model_name, monkeypatch
):
    """q, k and v (and LoRA's adapters) keep one pack of their shared input, and a norm offers
    its output rebuilt from its own pack: the first op to need a pack in backward unpacks it,
    the others take that tensor (``UnpackShare``). Before, each op unpacked its own: BERT's
    "uniform" step made 25 dequantize launches for 17 packs, the LoRA LLaMA's 42 for 33."""
    from hf_actq.codecs.packed import Packed
    from hf_actq.ops import norm

    read_packed = []
    in_kernel = norm._dequantized_in_kernel
    monkeypatch.setattr(
        norm,
        "_dequantized_in_kernel",
        lambda *a: read_packed.append(in_kernel(*a)) or read_packed[-1],
    )
    model, batch = _model(model_name)
    budget = _step_budget(model, batch, ActQConfig.from_recipe("uniform"))
    launches = budget.triton_launches
    # A gated MLP's kernel packs act(gate) and up (PEFT's down_proj lora_A unpacks them), a
    # norm's packs x_hat; a norm whose output no op took reads its pack inside its backward.
    packs = launches["aq_quantize_kernel"] + 2 * launches["gated_forward_kernel"]
    packs += launches["norm_pack_kernel"]
    read_in_kernel = sum(read_packed[len(read_packed) // 2 :])  # the measured (second) step
    assert launches["aq_dequantize_kernel"] + read_in_kernel == packs, launches

    def gradients():
        torch.manual_seed(0)
        model, batch = _model(model_name)
        hf_actq.apply(model, ActQConfig.from_recipe("uniform"))
        model.train()
        torch.manual_seed(1)
        model(**batch).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    shared = gradients()
    monkeypatch.setattr(Packed, "unpack", lambda packed: packed._unpack())  # each its own
    monkeypatch.setattr(norm, "_dequantized_in_kernel", lambda *args: False)
    own = gradients()
    assert shared.keys() == own.keys() and len(shared) > 10
    for name in shared:
        assert torch.equal(shared[name], own[name]), name
