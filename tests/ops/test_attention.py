import pytest
import torch
from transformers.models.bert.modeling_bert import eager_attention_forward

from hf_actq import SavedTensorMeter
from hf_actq.codecs import uniform
from hf_actq.codecs.packed import draw_seed
from hf_actq.ops.attention import compressed_eager_attention, register_attention
from hf_actq.ops.dedup import PackCache
from hf_actq.ops.dropout import keep_mask
from hf_actq.testing import tiny_bert

B, H, S, D = 2, 4, 24, 16
EXACT8 = uniform(8, stochastic=False)


class Holder(torch.nn.Module):
    pass


def _inputs(seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    mask = torch.zeros(B, 1, 1, S)
    mask[1, ..., -5:] = torch.finfo(torch.float32).min
    return q, k, v, mask


def _grads(out, tensors, grad):
    for t in tensors:
        t.grad = None
    out.backward(grad)
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize(
    "codecs", [{}, {"q": EXACT8, "k": EXACT8, "v": EXACT8, "probs": EXACT8}], ids=["exact", "8bit"]
)
def test_eval_matches_eager_forward_and_gradients(codecs):
    module = Holder().eval()
    q, k, v, mask = _inputs()
    grad = torch.randn(B, S, H, D)
    out, _ = compressed_eager_attention(
        module, q, k, v, mask, dropout=0.1, codecs=codecs, cache=PackCache()
    )
    ref, _ = eager_attention_forward(module, q, k, v, mask, dropout=0.1)
    assert torch.equal(out, ref)
    got, want = _grads(out, (q, k, v), grad), _grads(ref, (q, k, v), grad)
    tolerance = 1e-5 if not codecs else 0.02
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= tolerance * b.abs().max()


def test_training_dropout_uses_one_mask_in_forward_and_backward():
    module = Holder().train()
    q, k, v, mask = _inputs()
    grad = torch.randn(B, S, H, D)
    torch.manual_seed(7)
    out, weights = compressed_eager_attention(module, q, k, v, mask, dropout=0.2, cache=PackCache())
    got = _grads(out, (q, k, v), grad)
    torch.manual_seed(7)
    keep = keep_mask((B, H, S, S), 0.2, draw_seed(), q.device)
    probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + mask, dim=-1)
    ref = torch.matmul(probs * keep * (1 / 0.8), v).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.equal(weights != 0, keep & (probs != 0))
    assert 0.15 < 1 - keep.float().mean().item() < 0.25
    want = _grads(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_saved_bytes_are_the_packed_slots_only():
    module = Holder().train()
    q, k, v, mask = _inputs()
    codec = uniform(4)
    codecs = dict.fromkeys(("q", "k", "v", "probs"), codec)
    with SavedTensorMeter() as exact:
        eager_attention_forward(module, q, k, v, mask, dropout=0.1)
    with SavedTensorMeter() as ours:
        compressed_eager_attention(
            module, q, k, v, mask, dropout=0.1, codecs=codecs, cache=PackCache()
        )
    # The dropout mask is regenerated from a seed kept as a Python int: no tensor at all.
    expected = 3 * codec.nbytes(q.shape) + codec.nbytes((B, H, S, S))
    assert ours.nbytes == expected
    assert exact.nbytes > 6 * ours.nbytes


def _bert(implementation: str, dropout: float = 0.1):
    return tiny_bert(attention_probs_dropout_prob=dropout, attn_implementation=implementation)


def test_registered_with_transformers_for_a_bert_model():
    model = _bert("eager").eval()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    expected = model(input_ids=ids, attention_mask=mask).logits
    model.config._attn_implementation = register_attention()
    got = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, expected)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1])).loss.backward()
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad is not None


def _llama(heads=4, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _run(model, implementation, ids, mask):
    model.zero_grad()
    model.config._attn_implementation = implementation
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sdpa_path_exact_slots_match_sdpa(padded, kv_heads):
    from hf_actq.ops.attention import register_sdpa_attention

    model = _llama(kv_heads=kv_heads)
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[0, :4] = 0  # left padding: some query rows see no key at all
    logits, grads = _run(model, "sdpa", ids, mask if padded else None)
    ours, our_grads = _run(model, register_sdpa_attention(), ids, mask if padded else None)
    assert torch.equal(ours, logits)
    for a, b in zip(our_grads, grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_sdpa_path_compressed_keeps_q_k_v_only():
    from hf_actq.ops.attention import compressed_sdpa_attention

    module = Holder()
    module.is_causal = True
    module.num_key_value_groups = 4
    torch.manual_seed(0)
    q = torch.randn(2, 8, 32, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, requires_grad=True) for _ in range(2))
    codec = uniform(8, stochastic=False)
    codecs = dict.fromkeys(("q", "k", "v"), codec)
    with SavedTensorMeter() as meter:
        out, _ = compressed_sdpa_attention(module, q, k, v, None, codecs=codecs, cache=PackCache())
    # Lossy q and k: backward renormalises its own logits, so no row statistics are kept.
    assert meter.nbytes == codec.nbytes(q.shape) + 2 * codec.nbytes(k.shape)
    grad = torch.randn(out.shape)
    got = _grads(out, (q, k, v), grad)
    exact_out, _ = compressed_sdpa_attention(module, q, k, v, None, codecs={}, cache=PackCache())
    want = _grads(exact_out, (q, k, v), grad)
    for a, b in zip(got, want):
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cosine > 0.999


@pytest.mark.parametrize(("scale", "bits", "min_cosine"), [(4, 2, None), (2, 3, 0.5)])
def test_sdpa_backward_stays_stable_when_lossy_logits_are_large(scale, bits, min_cosine):
    # Large q and k (as after Qwen3's q_norm/k_norm) make the logit errors of low-bit codes
    # several units; exp(lossy logits - exact lse) then overflows (NaN at 2 bits) or points
    # nowhere (cosine near 0 at 3 bits). Renormalising the recomputed rows keeps them
    # distributions.
    from hf_actq.ops.attention import compressed_sdpa_attention

    module = Holder()
    module.is_causal = True
    module.num_key_value_groups = 1
    torch.manual_seed(0)
    q, k, v = (scale * torch.randn(1, 4, 64, 32) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn(1, 64, 4, 32)
    exact_out, _ = compressed_sdpa_attention(module, q, k, v, None, codecs={}, cache=PackCache())
    want = _grads(exact_out, (q, k, v), grad)
    codecs = dict.fromkeys(("q", "k", "v"), uniform(bits))
    out, _ = compressed_sdpa_attention(module, q, k, v, None, codecs=codecs, cache=PackCache())
    got = _grads(out, (q, k, v), grad)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        if min_cosine is not None:
            cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
            assert cosine > min_cosine


def test_sdpa_encoder_with_dropout_and_padding_matches_stock_sdpa():
    # Exact q, k, v: backward recomputes SDPA with the forward's RNG state, so the dropout mask
    # is the one the forward drew and the gradients are stock SDPA's.
    from hf_actq.ops.attention import register_sdpa_attention

    model = _bert("sdpa", dropout=0.3).train()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    results = {}
    for implementation in ("sdpa", register_sdpa_attention()):
        model.zero_grad()
        model.config._attn_implementation = implementation
        torch.manual_seed(1)  # the same dropout draws
        out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1]))
        out.loss.backward()
        after = torch.rand(1)  # the RNG stream continues where stock SDPA leaves it
        results[implementation] = out.logits, [p.grad.clone() for p in model.parameters()], after
    (logits, grads, after), (ours, our_grads, our_after) = results.values()
    assert torch.equal(ours, logits) and torch.equal(our_after, after)
    for a, b in zip(our_grads, grads):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("key_layout", ["head", "sequence"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sdpa_path_keeps_no_s_by_s_tensor(dropout, key_layout):
    from torch.nn.functional import scaled_dot_product_attention

    from hf_actq.memory.peak import PeakMemory
    from hf_actq.ops.attention import _capture_rng, compressed_sdpa_attention
    from hf_actq.ops.state import OpState, set_state

    module = Holder()
    module.is_causal = False
    module.training = True
    # K packed along the sequence (ALAM's layout) comes back as a transposed view; the fused
    # kernels need its last dimension contiguous, or SDPA takes its S x S math path.
    set_state(module, OpState(key_layout=key_layout))
    # Long enough that the fused kernel's blocks are smaller than the whole score matrix.
    b, h, s, d = 1, 1, 2048, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    codec = uniform(4)
    with SavedTensorMeter() as meter:
        out, _ = compressed_sdpa_attention(
            module, q, k, v, mask, dropout=dropout, codecs=dict.fromkeys("qkv", codec)
        )
    rng_bytes = sum(s.numel() for s in _capture_rng(q.device)[1]) if dropout else 0
    assert meter.nbytes == 3 * codec.nbytes(q.shape) + mask.numel() + rng_bytes
    with SavedTensorMeter() as stock:
        scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout)
    assert meter.nbytes < stock.nbytes / 4
    with PeakMemory("cpu") as peak:
        out.backward(torch.randn(out.shape))
    # Without dropout the fused CPU kernel recomputes the attention in blocks of 512 keys (its
    # largest buffer is S x 512): no allocation comes near one head's S x S scores. Dropout
    # takes SDPA's math path, in backward here as in stock SDPA's forward.
    if dropout == 0.0:
        assert peak.largest_bytes <= s * 512 * 4 < s * s * 4


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("query_length", [S, 9], ids=["self", "cross"])
def test_sdpa_path_with_position_bias_matches_stock_with_its_gradient(causal, query_length):
    # T5 adds a learned relative-position bias [1, heads, q, k] to the scores; the op takes it
    # as an input and returns its gradient (through transformers' own mask folding), for self-
    # and cross-attention (a query of another length than the keys).
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_actq.ops.attention import compressed_sdpa_attention

    module = Holder().train()
    module.is_causal = causal
    q, k, v, mask = _inputs()
    q = q[:, :, :query_length].detach().requires_grad_()
    mask = None if causal else mask
    bias = torch.randn(1, H, query_length, S, requires_grad=True)
    grad = torch.randn(B, query_length, H, D)
    results = []
    for attention, extra in (
        (sdpa_attention_forward, {}),
        (compressed_sdpa_attention, {"codecs": dict.fromkeys("qkv")}),  # kept exact
    ):
        out, _ = attention(module, q, k, v, mask, scaling=1.0, position_bias=bias, **extra)
        results.append((out, _grads(out, (q, k, v, bias), grad)))
    (out, grads), (ours, our_grads) = results
    torch.testing.assert_close(ours, out)
    for a, b in zip(our_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["head", "sequence"])
def test_k_is_averaged_along_the_dimension_its_layout_names(layout):
    # ALAM's code packs the transposed K the score matmul reads: its AQ groups run along the
    # sequence, where ours ran along head_dim (ActQConfig.key_layout).
    from hf_actq.codecs import AverageQuantCodec
    from hf_actq.ops.attention import _slots
    from hf_actq.ops.state import OpState

    codec = AverageQuantCodec(bits=8, group_size=4, stochastic=False)
    state = OpState(codecs={"k": codec}, cache=PackCache(), key_layout=layout)
    _, k, _, _ = _inputs()
    slot = _slots(state, ["k"])["k"]
    saved: list = []
    slot.keep(k.detach(), saved, state, "k")
    rebuilt = slot.restore(saved)
    assert rebuilt.shape == k.shape
    along = -2 if layout == "sequence" else -1  # groups of 4 share one mean
    groups = rebuilt.unflatten(along, (-1, 4))
    assert torch.equal(groups, groups.narrow(along, 0, 1).expand_as(groups))
    means = k.detach().unflatten(along, (-1, 4)).mean(along, keepdim=True)
    torch.testing.assert_close(groups.narrow(along, 0, 1), means, atol=0.05, rtol=0)


# A decoder's own eager function, recomputed in backward --------------------------------------
def _sink_attention(dropout=0.0, groups=2):
    """A module as gpt-oss's eager function reads it: learned sinks, grouped k and v."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from hf_actq.ops.state import OpState, set_state

    module = Holder().train()
    module.num_key_value_groups = groups
    module.sinks = torch.nn.Parameter(torch.randn(H))
    module.attention_dropout = dropout
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = (torch.randn(B, H // groups, S, D, requires_grad=True) for _ in range(2))
    mask = torch.zeros(B, 1, S, S)
    mask[1, ..., :5] = torch.finfo(torch.float32).min  # left padding
    return module, eager_attention_forward, (q, k, v, mask), (OpState, set_state)


def _recomputed(module, function, codecs, set_state, OpState):
    from hf_actq.ops.attention import compressed_eager_recompute_attention

    set_state(module, OpState(codecs=codecs, cache=PackCache(), attention_function=function))
    return compressed_eager_recompute_attention


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_eager_recompute_is_the_models_eager_function_with_its_gradients(dropout):
    # Exact q, k, v: the output and weights are the function's own, bit for bit, and backward
    # (the function run again, with the forward's dropout mask) gives its gradients, the sinks'
    # (a parameter the function reads from the module) included; the RNG stream goes on where
    # the stock function leaves it.
    module, function, (q, k, v, mask), (OpState, set_state) = _sink_attention(dropout)
    ours = _recomputed(module, function, dict.fromkeys("qkv"), set_state, OpState)
    grad = torch.randn(B, S, H, D)
    grad_weights = torch.randn(B, H, S, S)
    tensors = (q, k, v, module.sinks)
    results = []
    for attention in (function, ours):
        torch.manual_seed(1)
        out, weights = attention(module, q, k, v, mask, dropout=dropout, scaling=D**-0.5)
        grads = _grads((out * grad).sum() + (weights * grad_weights).sum(), tensors, None)
        results.append((out, weights, grads, torch.rand(1)))
    (out, weights, grads, after), (our_out, our_weights, our_grads, our_after) = results
    assert torch.equal(our_out, out) and torch.equal(our_weights, weights)
    assert torch.equal(our_after, after)
    for a, b in zip(our_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_eager_recompute_keeps_packed_q_k_v_and_the_mask_only():
    module, function, (q, k, v, mask), (OpState, set_state) = _sink_attention()
    codec = uniform(4)
    ours = _recomputed(module, function, dict.fromkeys("qkv", codec), set_state, OpState)
    params = [module.sinks]
    with SavedTensorMeter(exclude=params) as meter:
        out, _ = ours(module, q, k, v, mask, scaling=D**-0.5)
    assert meter.nbytes == codec.nbytes(q.shape) + 2 * codec.nbytes(k.shape) + mask.nbytes
    with SavedTensorMeter(exclude=params) as stock:
        function(module, q, k, v, mask, scaling=D**-0.5)
    # Stock keeps the [S, S + 1] probabilities with their sink column, their [S, S] slice for
    # the value matmul, and the expanded k and v.
    assert stock.nbytes > 2 * B * H * S * S * 4 > 4 * meter.nbytes
    grads = _grads(out, (q, k, v, module.sinks), torch.randn(out.shape))
    assert all(torch.isfinite(g).all() for g in grads)


def test_eager_recompute_passes_soft_capping_and_keyword_tensors_through():
    # Gemma 2's eager function soft-caps the scores (a keyword option); T5's adds a position
    # bias given as a keyword tensor with its own gradient.
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.t5.modeling_t5 import eager_attention_forward as t5

    from hf_actq.ops.state import OpState, set_state

    module = Holder().train()
    module.num_key_value_groups, module.head_dim = 1, D
    q, k, v, mask = _inputs()
    mask = mask.expand(B, 1, S, S)
    bias = torch.randn(1, H, S, S, requires_grad=True)
    grad = torch.randn(B, S, H, D)
    for function, options, tensors in (
        (gemma2, {"softcap": 3.0}, (q, k, v)),
        (t5, {"position_bias": bias}, (q, k, v, bias)),
    ):
        ours = _recomputed(module, function, dict.fromkeys("qkv"), set_state, OpState)
        results = []
        for attention in (function, ours):
            out, _ = attention(module, q, k, v, mask, scaling=0.5, **options)
            results.append((out, _grads(out, tensors, grad)))
        (out, grads), (our_out, our_grads) = results
        assert torch.equal(our_out, out)
        for a, b in zip(our_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_eager_recompute_without_a_function_to_run_says_what_to_do(monkeypatch):
    # A module whose modeling file defines no eager_attention_forward (the patch leaves such
    # modules without state): called anyway, the op names the class and the way out.
    import sys
    import types

    from hf_actq.ops.attention import compressed_eager_recompute_attention, eager_function_of

    modeling = types.ModuleType("modeling_without_eager")
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    custom = type("CustomAttention", (torch.nn.Module,), {"__module__": modeling.__name__})
    module = custom()
    assert eager_function_of(module) is None
    q, k, v, mask = _inputs()
    with pytest.raises(RuntimeError, match="CustomAttention .* attention=False"):
        compressed_eager_recompute_attention(module, q, k, v, mask)
