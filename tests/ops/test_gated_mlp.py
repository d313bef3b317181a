import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_actq import SavedTensorMeter
from hf_actq.codecs import AverageQuantCodec, uniform
from hf_actq.fewbit import table_for
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
