"""The chunked linear + cross-entropy against ``F.linear`` + ``F.cross_entropy`` (the arithmetic
of transformers' ForCausalLMLoss), what it keeps for backward, and its largest transient."""

import pytest
import torch
import torch.nn.functional as F

from hf_actq.memory import PeakMemory, SavedTensorMeter, graph_saved_tensors
from hf_actq.ops.linear_cross_entropy import (
    causal_lm_loss,
    chunk_tokens_for,
    linear_cross_entropy,
)

VOCAB, HIDDEN = 50, 16


def _stock(hidden, weight, bias, labels, softcap=None, num_items=None, smoothing=0.0):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100,
        reduction="sum" if num_items else "mean", label_smoothing=smoothing,
    )  # fmt: skip
    return loss / num_items if num_items else loss


def _inputs(dtype, bias=True, seed=0):
    generator = torch.Generator(torch.get_default_device()).manual_seed(seed)
    hidden = torch.randn(3, 20, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(VOCAB, HIDDEN, generator=generator)).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=generator).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (3, 20), generator=generator)
    labels[0, :5] = -100  # a masked prompt
    return hidden, weight, b, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("num_items", [None, 37])
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_match_the_stock_loss(dtype, softcap, num_items, bias):
    hidden, weight, b, labels = _inputs(dtype, bias)
    params = [t for t in (hidden, weight, b) if t is not None]
    expected = _stock(hidden, weight, b, labels, softcap, num_items)
    expected_grads = torch.autograd.grad(3 * expected, params)
    loss = causal_lm_loss(hidden, weight, labels, b, softcap=softcap, num_items_in_batch=num_items)
    grads = torch.autograd.grad(3 * loss, params)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    # fp32: rounding only; bf16: the stock path rounds its fp32 gradient to bf16 before the
    # scale, this one after, so they differ by about one bf16 ulp.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < tolerance, error


@pytest.mark.parametrize("chunk", [1, 7, 60, None])
def test_every_chunking_and_label_smoothing_agree(chunk):
    hidden, weight, _, labels = _inputs(torch.float32, bias=False)
    flat_hidden, flat_labels = hidden.reshape(-1, HIDDEN), labels.reshape(-1)
    expected = F.cross_entropy(flat_hidden @ weight.t(), flat_labels, label_smoothing=0.1)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(
        flat_hidden, weight, flat_labels, label_smoothing=0.1, chunk_tokens=chunk
    )
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_keeps_only_the_hidden_gradient_and_no_vocab_sized_tensor():
    tokens, hidden_size, vocab = 512, 32, 4096
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size) * 0.1  # frozen, as under LoRA
    targets = torch.randint(0, vocab, (tokens,))
    with SavedTensorMeter(exclude=[weight]) as stock_meter:
        stock = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    with SavedTensorMeter(exclude=[weight]) as meter, PeakMemory() as peak:
        loss = linear_cross_entropy(hidden, weight, targets)
    # Kept: the [tokens, hidden] gradient alone (stock: the log-probabilities, tokens x vocab).
    assert meter.nbytes == hidden.numel() * 4
    assert stock_meter.nbytes >= tokens * vocab * 4
    # The largest transient is a chunk of logits, about the size of the hidden states.
    chunk = chunk_tokens_for(tokens, hidden_size, vocab)
    assert peak.largest_bytes <= chunk * vocab * 4 <= 2 * hidden.numel() * 4
    loss.backward()
    expected = torch.autograd.grad(stock, hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_items", [None, 0, 7])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    "head",
    [
        "trained",  # recomputed in backward, token chunk by token chunk
        "trained-bf16",  # bf16 weight, more words than tokens: by vocabulary block
        "frozen",  # the hidden states' gradient formed in the forward
    ],
)
def test_a_batch_with_no_supervised_token_behaves_as_the_stock_loss(head, smoothing, num_items):
    # Every label ignored (a prompt longer than the sequence, a padded micro-batch, one token):
    # the stock loss is NaN for the mean (0/0) and for num_items_in_batch=0, 0 otherwise, and
    # its gradients are exact zeros in every case.
    dtype = torch.bfloat16 if head == "trained-bf16" else torch.float32
    hidden, weight, bias, labels = _inputs(dtype, bias=True)
    hidden = hidden.detach()[:, :1].clone().requires_grad_()  # one token per row
    labels = labels[:, :1]
    weight.requires_grad_(head != "frozen")
    bias.requires_grad_(head != "frozen")
    params = [t for t in (hidden, weight, bias) if t.requires_grad]
    for shifted in (None, torch.full_like(labels, -100)):
        expected = _stock(hidden, weight, bias, labels, num_items=num_items, smoothing=smoothing)
        expected_grads = torch.autograd.grad(expected, params)
        loss = causal_lm_loss(
            hidden, weight, labels, bias, shift_labels=shifted, num_items_in_batch=num_items
        )
        if smoothing:
            loss = linear_cross_entropy(
                hidden, weight, torch.full_like(labels, -100), bias, label_smoothing=smoothing,
                num_items_in_batch=num_items,
            )  # fmt: skip
        grads = torch.autograd.grad(loss, params)
        assert torch.isnan(loss) == torch.isnan(expected), (loss, expected)
        if not torch.isnan(expected):
            assert loss == expected == 0
        for got, want in zip(grads, expected_grads, strict=True):
            assert not torch.count_nonzero(want)
            assert not torch.count_nonzero(got), got


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(targets=torch.zeros(4, dtype=torch.long)), "must agree in every dimension"),
        (dict(weight=torch.randn(VOCAB, HIDDEN + 1)), "does not match the head's weight"),
        (dict(label_smoothing=1.5), "label_smoothing must be in"),
        (dict(chunk_tokens=0), "chunk_tokens must be >= 1"),
    ],
)
def test_bad_input_is_reported_clearly(kwargs, match):
    arguments = dict(
        hidden=torch.randn(5, HIDDEN),
        weight=torch.randn(VOCAB, HIDDEN),
        targets=torch.zeros(5, dtype=torch.long),
    )
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**arguments)


def test_a_trained_head_keeps_the_hidden_states_and_recomputes_in_backward():
    tokens, hidden_size, vocab = 256, 32, 4096
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) * 0.1).requires_grad_()
    bias = torch.zeros(vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with SavedTensorMeter(exclude=[weight, bias]) as meter:
        loss = linear_cross_entropy(hidden, weight, targets, bias)
    # The hidden states (the input itself), the targets and their validity: no weight-sized
    # gradient held from the forward on, and nothing vocabulary-sized.
    assert meter.nbytes <= hidden.numel() * 4 + tokens * (8 + 1) + 4
    grads = torch.autograd.grad(2 * loss, (hidden, weight, bias))
    expected = torch.autograd.grad(
        2 * F.cross_entropy(F.linear(hidden, weight, bias), targets), (hidden, weight, bias)
    )
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_trained_head_keeps_nothing_vocabulary_sized(backend, dtype):
    # Traced op by op, the backward's recomputed logits would be merged with the forward's and
    # kept: every chunk's fp32 log-probabilities from forward to backward. bf16 walks the
    # vocabulary in backward (more words than tokens) and keeps each token's log-sum-exp too.
    torch._dynamo.reset()
    tokens, hidden_size, vocab = 64, 16, 512
    hidden = torch.randn(tokens, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))

    def loss_of(h, w):
        return linear_cross_entropy(torch.tanh(h), w, targets, chunk_tokens=16)

    loss = torch.compile(loss_of, backend=backend, fullgraph=True)(hidden, weight)
    saved = graph_saved_tensors(loss, exclude=[hidden, weight])
    assert saved, "the compiled graph keeps its input for backward"
    assert all(t.numel() < tokens * vocab // 4 for t in saved), [t.shape for t in saved]
    per_token = hidden_size * hidden.element_size() + 8 + 1 + (4 if dtype != torch.float32 else 0)
    # Each storage once (aot_eager saves the log-sum-exp as views of one buffer).
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    assert sum(storages.values()) <= tokens * per_token + 8
    got = torch.autograd.grad(loss, (hidden, weight))
    expected = torch.autograd.grad(loss_of(hidden, weight), (hidden, weight))
    for g, e in zip(got, expected):
        if dtype == torch.float32:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        else:  # the compiled tanh rounds differently in bf16
            assert (g.float() - e.float()).norm() / e.float().norm() < 2e-2


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_half_precision_head_with_more_words_than_tokens_walks_the_vocabulary(
    softcap, bias, smoothing
):
    # 40 tokens, 300 words, bf16: backward by vocabulary block (from the forward's log-sum-exp).
    generator = torch.Generator(torch.get_default_device()).manual_seed(3)
    hidden = torch.randn(2, 20, HIDDEN, generator=generator).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(300, HIDDEN, generator=generator)).bfloat16().requires_grad_()
    b = torch.randn(300, generator=generator).bfloat16().requires_grad_() if bias else None
    labels = torch.randint(0, 300, (2, 20), generator=generator)
    labels[0, :5] = -100
    params = [t for t in (hidden, weight, b) if t is not None]
    logits = F.linear(hidden, weight, b) * 0.5
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    expected = F.cross_entropy(
        logits.float().reshape(-1, 300), shifted.reshape(-1), label_smoothing=smoothing
    )
    expected_grads = torch.autograd.grad(expected, params)
    loss = causal_lm_loss(hidden, weight, labels, b, softcap=softcap, logit_scale=0.5)
    if smoothing:  # through the general entry point, which takes the smoothing
        loss = linear_cross_entropy(
            hidden, weight, shifted, b, label_smoothing=smoothing, softcap=softcap,
            logit_scale=0.5,
        )  # fmt: skip
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 2e-2, error


def test_walking_the_vocabulary_never_holds_an_fp32_weight_gradient(monkeypatch):
    import hf_actq.ops.linear_cross_entropy as lce

    if torch.get_default_device().type != "cpu":
        pytest.skip("the largest single allocation is read from the CPU profiler")
    tokens, vocab = 256, 8192
    hidden = torch.randn(tokens, HIDDEN).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(vocab, HIDDEN)).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    fp32_gradient = vocab * HIDDEN * 4
    largest = {}
    for by_vocabulary in (True, False):
        monkeypatch.setattr(lce, "_by_vocabulary_block", lambda *_, v=by_vocabulary: v)
        loss = linear_cross_entropy(hidden, weight, targets)
        with PeakMemory() as peak:
            grads = torch.autograd.grad(loss, (hidden, weight))
        largest[by_vocabulary] = peak.largest_bytes
        if by_vocabulary:
            first = grads
    # Token chunks sum the weight gradient in fp32; vocabulary blocks write it in bf16.
    assert largest[False] >= fp32_gradient > largest[True]
    for got, want in zip(first, grads):
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 1e-2, error


@pytest.mark.parametrize("head", ["frozen", "trained"])
@pytest.mark.parametrize("num_items", [None, 700])
def test_fp16_gradients_under_a_loss_scale_are_as_good_as_stocks(head, num_items):
    # A GradScaler's 65536 is no fp16 number, and 1/tokens times a 32k-word softmax flushes to
    # zero in fp16: the frozen head's gradient, formed in the forward, used to be all inf at
    # 65536 and 4x the stock error at 32768. The error is against the same computation in fp32.
    generator = torch.Generator(torch.get_default_device()).manual_seed(0)
    hidden32 = torch.randn(512, 16, generator=generator)
    weight32 = 0.05 * torch.randn(32000, 16, generator=generator)
    labels = torch.randint(0, 32000, (512,), generator=generator)
    trained = head == "trained"

    def gradients(loss_fn, dtype, scale):
        hidden = hidden32.to(dtype).requires_grad_()
        weight = weight32.to(dtype).requires_grad_(trained)
        loss = loss_fn(hidden, weight)
        inputs = [hidden, weight] if trained else [hidden]
        return [g.float() / scale for g in torch.autograd.grad(loss * scale, inputs)]

    def stock(hidden, weight):
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits, labels, reduction="sum" if num_items else "mean")
        return loss / num_items if num_items else loss

    def fused(hidden, weight):
        return linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num_items)

    exact = gradients(stock, torch.float32, 1.0)
    for scale in (65536.0, 32768.0):
        want = gradients(stock, torch.float16, scale)
        got = gradients(fused, torch.float16, scale)
        for reference, stock_grad, grad in zip(exact, want, got, strict=True):
            assert torch.isfinite(stock_grad).all() and torch.isfinite(grad).all()
            stock_error = (stock_grad - reference).norm() / reference.norm()
            error = (grad - reference).norm() / reference.norm()
            assert error <= 2 * stock_error, (scale, error.item(), stock_error.item())
