"""Linear + cross-entropy over chunks of tokens: a causal LM's head and loss without a
[tokens, vocab] tensor kept for backward or alive at once.

The stock head computes the logits (model dtype), upcasts them to fp32 and takes the
cross-entropy, and autograd keeps the fp32 log-probabilities (and the logits) until backward: at
LLaMA2-7B shapes, 8 x 512 tokens x 32,000 words, 0.49 GiB of fp32 that no codec touches, and the
bf16 logits plus their fp32 copy at the peak. Here the forward walks the tokens a chunk at a
time. With a frozen head (LoRA, QLoRA) it also forms, while each chunk's logits are at hand, the
gradient with respect to the hidden states, and backward only scales it (as Liger-Kernel's fused
linear cross-entropy does); with a trained head (full fine-tuning, tied embeddings) it keeps the
hidden states and each token's target and validity, and backward recomputes the logits chunk by
chunk (one extra head matmul) rather than hold a weight-sized gradient from the forward on.
Either way what is kept is one [tokens, hidden] tensor in the model dtype, the size of the
hidden states the stock head keeps anyway, plus a few bytes per token.

A trained head's weight gradient is summed over the token chunks in fp32, a [vocab, hidden]
buffer twice the size of a half-precision gradient (and alive beside it at the cast): for
half-precision heads with more words than tokens, backward walks the vocabulary in blocks
instead, from each token's log-sum-exp kept by the forward, writing each block's weight
gradient once in the model dtype and summing the [tokens, hidden] input gradient in fp32.

In fp16 the gradient formed in the forward is kept at a power-of-two headroom rather than
scaled by 1/tokens (which flushes a large vocabulary's small probabilities to zero), and backward
applies the rest with the incoming gradient in fp32: a GradScaler's 65536 is no fp16 number.

The arithmetic follows transformers' ``ForCausalLMLoss``: logits in the model dtype, optional
soft-capping ``cap * tanh(logits / cap)`` in the model dtype (Gemma 2), fp32 log-softmax, the
mean over tokens whose label is not ``ignore_index`` or the sum over ``num_items_in_batch``
(gradient accumulation). Equal to it up to floating-point rounding (chunked matmuls, the
gradient formed in fp32 before the cast). No Triton kernel: the work is in the matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_actq.kernels.packing import row_chunks
from hf_actq.ops.state import once_differentiable

IGNORE_INDEX = -100


def chunk_tokens_for(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk so that one chunk's [chunk, vocab] logits hold about as many elements as
    the [tokens, hidden] hidden states (Liger-Kernel's rule): the transient stays within the
    size of what the stock head keeps, and the matmuls stay large. At least 1."""
    return max(1, min(tokens, -(-tokens * hidden // vocab)))


def _scaled_logits(h, weight, bias, softcap, logit_scale):
    """The head's logits as the stock forward computes them (model dtype), and the tanh of the
    soft-capping (None without it)."""
    logits = F.linear(h, weight, bias)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    return logits, capped


def _chunk_loss_and_grad(
    h, weight, bias, target, keep, softcap, logit_scale, smoothing, scale, want_grad, lse=None
):
    """One chunk: the sum of its tokens' losses (fp32) and, with ``want_grad``, d(loss)/d(logits)
    times ``scale`` in the model dtype (softmax minus the smoothed one-hot, 0 where ignored).
    The logits are ``linear(h, weight, bias) * logit_scale``, then soft-capped. ``lse``, a list,
    receives each token's fp32 log-sum-exp of the logits when given."""
    logits, capped = _scaled_logits(h, weight, bias, softcap, logit_scale)
    upcast = logits.float()
    del logits
    if lse is None:
        log_probs = torch.log_softmax(upcast, dim=-1)
    else:
        # One pass for both: the log-probabilities are the logits less their log-sum-exp.
        lse.append(torch.logsumexp(upcast, dim=-1))
        log_probs = upcast.sub_(lse[-1][:, None])
    del upcast
    safe_target = torch.where(keep, target, 0)
    nll = -log_probs.gather(1, safe_target[:, None]).squeeze(1)
    if smoothing:
        nll = (1 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)
    total = torch.where(keep, nll, 0).sum()
    if not want_grad:
        return total, None
    grad = log_probs.exp_()
    del log_probs
    grad.scatter_add_(1, safe_target[:, None], torch.full_like(grad[:, :1], smoothing - 1))
    if smoothing:
        grad -= smoothing / weight.shape[0]
    grad *= scale * logit_scale
    if capped is not None:
        grad *= 1 - capped.float().square()
    # Ignored tokens get exact zeros whatever the scale, as the stock loss's backward skips
    # them: a batch with no supervised token has scale 1/0, and zero times inf is NaN.
    grad.masked_fill_(~keep[:, None], 0)
    return total, grad.to(h.dtype)


def _by_vocabulary_block(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a trained head's backward walks the vocabulary: a half-precision weight (whose
    fp32 gradient sum over token chunks would be twice its gradient) with more words than
    tokens (so the fp32 input-gradient sum this takes instead is the smaller one)."""
    return weight.dtype != torch.float32 and hidden.shape[0] < weight.shape[0]


def _gradients_by_vocabulary_block(
    hidden, weight, bias, targets, valid, scale, lse, softcap, logit_scale, smoothing,
    need_hidden, need_weight, need_bias,
):  # fmt: skip
    """:func:`recompute_gradients` a block of words at a time: each block's logits for every
    token, their softmax from the forward's ``lse``, the block's weight (and bias) gradient
    written once in the model dtype, the hidden states' gradient summed in fp32. A block's
    [tokens, block] logits are about the size of the hidden states."""
    tokens, width = hidden.shape
    vocab = weight.shape[0]
    block = max(1, min(vocab, width))
    grad_hidden = torch.zeros(tokens, width, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    grad_bias = torch.empty_like(bias) if need_bias else weight.new_empty(0)
    factor = scale * logit_scale
    rows = valid.nonzero().squeeze(1)
    target = targets[rows]
    for start in range(0, vocab, block):
        end = min(start + block, vocab)
        part = weight[start:end]
        logits, capped = _scaled_logits(
            hidden, part, None if bias is None else bias[start:end], softcap, logit_scale
        )
        grad = torch.exp(logits.float() - lse[:, None])
        del logits
        hit = (target >= start) & (target < end)
        grad[rows[hit], target[hit] - start] += smoothing - 1
        if smoothing:
            grad -= smoothing / vocab
        grad *= factor
        if capped is not None:
            grad *= 1 - capped.float().square()
        grad.masked_fill_(~valid[:, None], 0)  # exact zeros, as in _chunk_loss_and_grad
        if need_weight:
            grad_weight[start:end] = grad.to(hidden.dtype).t() @ hidden
        if need_bias:
            grad_bias[start:end] = grad.sum(0)
        if need_hidden:
            grad_hidden.addmm_(grad, part.float())
    return (
        grad_hidden.to(hidden.dtype) if need_hidden else hidden.new_empty(0),
        grad_weight,
        grad_bias,
    )


# One opaque operator for the trained head's backward. Traced op by op, torch.compile would see
# that backward recomputes the very logits forward computed, merge the two, and keep every
# chunk's fp32 log-probabilities from forward to backward: a [tokens, vocab] fp32 tensor, the
# one this op exists to avoid (measured on a compiled tiny LLaMA before this was an operator).
@torch.library.custom_op("hf_actq::linear_cross_entropy_backward", mutates_args=())
def recompute_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    lse: torch.Tensor | None,
    softcap: float | None,
    logit_scale: float,
    smoothing: float,
    chunk: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``scale`` times the summed loss with respect to the hidden states, the
    head's weight and its bias, the logits recomputed chunk by chunk (by vocabulary block when
    the forward kept each token's log-sum-exp ``lse``); an empty tensor for each gradient not
    asked for."""
    if lse is not None:
        return _gradients_by_vocabulary_block(
            hidden, weight, bias, targets, valid, scale, lse, softcap, logit_scale, smoothing,
            need_hidden, need_weight, need_bias,
        )  # fmt: skip
    fp32 = dict(dtype=torch.float32, device=weight.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, **fp32) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], **fp32) if need_bias else None
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        h = hidden[part]
        _, grad = _chunk_loss_and_grad(
            h, weight, bias, targets[part], valid[part], softcap, logit_scale, smoothing, scale,
            True,
        )  # fmt: skip
        if need_hidden:
            grad_hidden[part] = grad @ weight
        if need_weight:  # accumulated in fp32 across chunks
            if h.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), h)
            else:
                grad_weight.add_(grad.t() @ h)
        if need_bias:
            grad_bias += grad.float().sum(0)
    return (
        grad_hidden,
        grad_weight.to(weight.dtype) if need_weight else weight.new_empty(0),
        grad_bias.to(bias.dtype) if need_bias else weight.new_empty(0),
    )


@recompute_gradients.register_fake
def _(hidden, weight, bias, targets, valid, scale, lse, softcap, logit_scale, smoothing, chunk,
      need_hidden, need_weight, need_bias):  # fmt: skip
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else weight.new_empty(0),
        torch.empty_like(bias) if need_bias else weight.new_empty(0),
    )


def _fp16_headroom(weight: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """A power of two ``h`` (an fp32 tensor) for fp16 gradients formed as ``h * logit_scale *
    (softmax - one-hot) @ weight``: the factor is at most 2**15, and the product, at most
    ``2 h logit_scale max|weight|`` in magnitude, stays within a quarter of fp16's range."""
    largest = weight.detach().abs().amax().float().clamp_min(2.0**-24)
    bound = (16384.0 / largest).clamp_max(32768.0) / logit_scale
    return torch.exp2(torch.floor(torch.log2(bound))).clamp(2.0**-14, 2.0**15)


def _scaled(grad: torch.Tensor, grad_loss: torch.Tensor, late_scale) -> torch.Tensor:
    """``grad * grad_loss (* late_scale)`` in ``grad``'s dtype; with ``late_scale``, worked in
    fp32 a chunk of rows at a time, since the factor itself may exceed fp16 (a GradScaler's
    65536) and the product must round once."""
    if late_scale is None:
        return grad * grad_loss.to(grad.dtype)
    factor = late_scale * grad_loss.float()
    out = torch.empty_like(grad)
    for rows in row_chunks(grad.shape[0], grad.shape[1]):
        part = grad[rows]
        # Exact zeros stay zeros (ignored tokens), whatever the factor: a batch with no
        # supervised token has a scale of 1/0, and zero times inf is NaN.
        out[rows] = (part.float() * factor).masked_fill_(part == 0, 0).to(grad.dtype)
    return out


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Scalar loss of ``hidden @ weight.T (+ bias)`` against ``targets``; see the module.

    A frozen head (LoRA, QLoRA): the hidden states' gradient is formed in the forward and kept
    ([tokens, hidden]); backward scales it. A trained head: the forward keeps the hidden states
    and each token's target and validity, and backward recomputes the logits chunk by chunk for
    both gradients (:func:`recompute_gradients`), so no weight-sized gradient is held from the
    forward on."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, ignore_index, smoothing, softcap, logit_scale,
        num_items_in_batch, chunk_tokens,
    ):  # fmt: skip
        valid = targets != ignore_index
        if num_items_in_batch is None:
            normalizer = valid.sum().to(torch.float32)
        else:
            normalizer = torch.as_tensor(num_items_in_batch, dtype=torch.float32)
            normalizer = normalizer.to(hidden.device)
        scale = 1.0 / normalizer  # applied in fp32, before the gradients are cast
        ctx.recompute = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        grad_now = ctx.needs_input_grad[0] and not ctx.recompute
        grad_hidden = torch.empty_like(hidden) if grad_now else None
        # The gradient formed now is scaled by ``formed_scale``; backward multiplies it by
        # ``late_scale`` and the incoming gradient. fp16 cannot hold 1/tokens times small
        # probabilities (they flush to zero: 4x the stock gradient's error at 512 tokens),
        # nor a GradScaler's 65536 as a factor of its own: there the gradient is formed at
        # a power-of-two headroom that keeps it in range, and scaled down in fp32 in backward.
        formed_scale, ctx.late_scale = scale, None
        if grad_now and hidden.dtype == torch.float16:
            formed_scale = _fp16_headroom(weight, logit_scale)
            ctx.late_scale = scale / formed_scale
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunk = chunk_tokens or chunk_tokens_for(hidden.shape[0], hidden.shape[1], weight.shape[0])
        ctx.settings = (softcap, logit_scale, smoothing, chunk)
        # Each token's log-sum-exp, for a backward by vocabulary block (a list joined once: a
        # trace would copy a whole buffer per chunk written into).
        lse = [] if ctx.recompute and _by_vocabulary_block(hidden, weight) else None
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            loss, grad = _chunk_loss_and_grad(
                hidden[part], weight, bias, targets[part], valid[part], softcap, logit_scale,
                smoothing, formed_scale, grad_now, lse,
            )  # fmt: skip
            total += loss
            if grad_now:
                grad_hidden[part] = grad @ weight
        lse = None if lse is None else torch.cat(lse)
        if ctx.recompute:
            ctx.save_for_backward(hidden, weight, bias, targets, valid, scale, lse)
        else:
            ctx.save_for_backward(grad_hidden)
        return total / normalizer

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if not ctx.recompute:
            (grad_hidden,) = ctx.saved_tensors
            if grad_hidden is not None:
                grad_hidden = _scaled(grad_hidden, grad_loss, ctx.late_scale)
            return grad_hidden, None, None, None, None, None, None, None, None, None
        hidden, weight, bias, targets, valid, scale, lse = ctx.saved_tensors
        softcap, logit_scale, smoothing, chunk = ctx.settings
        need_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden, grad_weight, grad_bias = recompute_gradients(
            hidden, weight, bias, targets, valid, scale * grad_loss.float(), lse, softcap,
            logit_scale, smoothing, chunk, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            need_bias,
        )  # fmt: skip
        return (
            grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if ctx.needs_input_grad[1] else None,
            grad_bias if need_bias else None,
            None, None, None, None, None, None, None,
        )  # fmt: skip


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(linear(hidden, weight, bias).float(), targets)`` over any leading shape
    of ``hidden`` (``[..., hidden]``, ``targets`` ``[...]``), computed chunk by chunk; the mean
    over non-ignored targets, or their sum over ``num_items_in_batch`` when given. The logits
    are multiplied by ``logit_scale`` (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``), then soft-capped at ``softcap`` (Gemma 2)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} must agree "
            "in every dimension but the last"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} does not match the head's weight "
            f"{tuple(weight.shape)} ([vocab, hidden])"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return LinearCrossEntropyFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), ignore_index,
        float(label_smoothing), softcap, float(logit_scale), num_items_in_batch, chunk_tokens,
    )  # fmt: skip


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` from the hidden states ``[batch, seq, hidden]``: the
    labels shifted left by one (or ``shift_labels`` as given), the last position ignored."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return linear_cross_entropy(
        hidden, weight, shift_labels.to(hidden.device), bias, ignore_index=ignore_index,
        softcap=softcap, logit_scale=logit_scale, num_items_in_batch=num_items_in_batch,
    )  # fmt: skip
