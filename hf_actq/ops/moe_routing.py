"""What every MoE experts op shares: the routed (token, expert) pairs sorted by expert, as
transformers' grouped-matmul experts sort them, the per-token sum back, and the experts' weight
gradients over the routed spans."""

from __future__ import annotations

import functools

import torch


def route(top_k_index, experts: int):
    """``(expert of each row, the row's index into the flattened top-k pairs, the end of each
    expert's span of rows)``, rows sorted by expert."""
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    # histc, as transformers' grouped_mm path: bincount's output shape depends on the data,
    # which breaks a torch.compile graph (histc takes no integers on CPU).
    ids = expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids
    counts = torch.histc(ids, bins=experts, min=0, max=experts - 1)
    return expert_ids, perm, torch.cumsum(counts, dim=0, dtype=torch.int32)


def combine(out_rows, perm, top_k_shape):
    """Each token's sum over its top-k rows, in transformers' order (rows back in token order,
    then a sum over the top-k: deterministic, where an index_add would not be)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return out_rows[inverse].view(*top_k_shape, -1).sum(dim=1)


def expert_weight_grads(grad_rows, input_rows, offsets, weight):
    """Each expert's weight gradient ``grad_rows[span].t() @ input_rows[span]`` over its span of
    the expert-sorted rows, ``[experts, out, in]`` as ``weight``: one grouped matmul over the
    routed counts, as the grouped-matmul experts' own autograd computes it, with the counts left
    on the device (a loop over them reads them on the host: a sync per layer per step). Experts
    that got no row have zero gradients. A loop where the grouped matmul cannot run."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped_mm is not None and grad_rows.dtype == input_rows.dtype:
        # The operands' layouts of the autograd's own call (a transposed first operand).
        try:
            return grouped_mm(grad_rows.t(), input_rows, offs=offsets).to(weight.dtype)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):
            pass  # this device or dtype has no grouped matmul of two 2-D operands
    grads = torch.zeros_like(weight)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            grads[expert] = grad_rows[start:end].t() @ input_rows[start:end]
        start = end
    return grads


# One opaque operator for a grouped matmul's gradients under torch.compile: its shapes per expert
# depend on the routed counts (data), which a trace cannot follow. transformers has one from
# 5.21 (``transformers::grouped_mm_fallback_backward``), a per-expert loop that reads the counts
# on the host; this one leaves them on the device where the grouped matmul runs.
@torch.library.custom_op("hf_actq::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``rows[span] @ weight[e]`` over each expert's span of the sorted rows
    (``weight`` [experts, in, out]): ``(grad of rows, grad of weight)``."""
    from transformers.integrations.moe import _grouped_linear

    # [experts, in, out] is the transposed layout: x @ weight[e].T is the non-transposed call.
    grad_rows = _grouped_linear(grad_output, weight, offsets, is_transposed=False)
    grad_weight = expert_weight_grads(rows, grad_output, offsets, weight)
    # Contiguous, as the fake says (a transposed weight view would otherwise leave its layout
    # to whichever path computed the gradient).
    return grad_rows.contiguous(), grad_weight.contiguous()


@grouped_mm_backward.register_fake
def _(rows, weight, offsets, grad_output):
    return rows.new_empty(rows.shape), weight.new_empty(weight.shape)


# PEFT's LoRA on an experts parameter (``target_parameters``; "all-linear" on a Qwen3-MoE under
# transformers 5) folds ``base + scaling * lhs @ rhs`` into a merged copy of the whole expert
# stack each forward (a parametrization read under ``parametrize.cached()``); an op that saved
# that copy for backward kept a second set of expert weights per layer (1.125 GiB a layer on
# Qwen3-30B-A3B). The fold is a pure function of the base weight and the two factors, which
# stay alive anyway, so the ops keep how to rebuild it instead: with one adapter on a frozen
# base (PEFT's usual case) as base plus a rank-r path (:class:`LowRankWeight`), else by folding
# it again (:class:`RefoldedWeight`).
_FOLDS = ("_LoraFactorsProxy",)


class RefoldedWeight:
    """Rebuilds a parametrized weight, bit for bit, from its original and its folds.
    ``factors``: where known, how to make the one fold's ``(lhs, rhs)`` again (PEFT's own
    ``get_delta_factors`` for the active adapter)."""

    def __init__(self, original: torch.Tensor, folds: list, factors=None) -> None:
        self.original, self.folds = original, folds
        # One adapter's fold over a frozen base (a trained base needs the full gradient).
        self._low_rank = None
        if len(folds) == 1 and not original.requires_grad:
            self._low_rank = original, folds[0].lhs, folds[0].rhs, folds[0].scaling
        self.factors = factors if self._low_rank is not None else None

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            weight = self.original
            for fold in self.folds:
                weight = fold(weight)
        return weight

    def low_rank(self) -> tuple | None:
        """``(base, lhs, rhs, scaling)`` where the weight is one adapter's fold over a frozen
        base; None otherwise."""
        return self._low_rank


def refolded(module, name: str, wrappers: dict | None = None) -> RefoldedWeight | None:
    """How to rebuild ``getattr(module, name)`` in backward, where it is PEFT's LoRA fold of a
    parameter (and not under torch.compile, which traces the fold itself); None otherwise.
    ``wrappers``: the PEFT ``ParamWrapper`` of each parameter name, where ``apply`` found
    them (:func:`_factors_again`)."""
    from torch.nn.utils import parametrize

    if torch.compiler.is_compiling() or not parametrize.is_parametrized(module, name):
        return None
    chain = module.parametrizations[name]
    folds = list(chain)
    if not hasattr(chain, "original") or not all(type(f).__name__ in _FOLDS for f in folds):
        return None
    # A sharded original (DeepSpeed ZeRO-3's, FSDP2's DTensor) is whole only while its owner's
    # hooks have gathered it: the copy is kept there, as before.
    if hasattr(chain.original, "ds_id") or type(chain.original).__name__ == "DTensor":
        return None
    wrapper = (wrappers or {}).get(name)
    factors = _factors_again(wrapper, folds[0]) if wrapper is not None and len(folds) == 1 else None
    return RefoldedWeight(chain.original, folds, factors)


def _factors_again(wrapper, fold):
    """How to make ``fold``'s ``(lhs, rhs)`` again from the adapter's own weights, or None.
    PEFT folds in the base weight's dtype, so on a bf16 model with fp32 adapters (its default)
    the factors are bf16 copies of the adapters (19.5 MiB a layer at Qwen3-30B-A3B, more than
    the rest of the layer keeps under "alam"); an op that kept them for backward held them as
    activations. Made again in backward, the copies live there only."""
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(adapters) != 1 or wrapper.scaling[adapters[0]] != fold.scaling:
        return None
    return functools.partial(_factors, wrapper, adapters[0])


def _factors(wrapper, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        lhs, rhs, _ = wrapper.get_delta_factors(adapter)
    return lhs, rhs


class LowRankWeight:
    """An experts weight ``base + scaling * lhs @ rhs`` (one LoRA adapter, its base frozen) as
    its parts. Backward multiplies by it as the base plus a rank-r path and gives the factors
    their gradients from r-wide products: it never folds the weight again (a transient of the
    expert weights' size per layer) nor forms its full gradient (as many FLOPs as the
    projection's forward, and another such transient) only to reduce it to the factors'. The
    forward keeps the stock fold, so outputs stay bit for bit; gradients change by rounding."""

    def __init__(self, base, lhs, rhs, scaling) -> None:
        self.base, self.lhs, self.rhs, self.scaling = base, lhs, rhs, scaling
        self.rank = lhs.shape[-1]
        self.operands = {}

    def factors(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lhs, rhs)`` in ``dtype``, made once per dtype: contiguous (PEFT's are views of its
        adapters, lhs with an experts stride of 1, which CUDA's grouped matmul does not take)
        and padded with zeros to a rank that is a multiple of 8 (its operands' rows must be
        16-byte multiples); the products are unchanged, and they are small."""
        if dtype not in self.operands:
            pad = -self.rank % 8
            lhs = torch.nn.functional.pad(self.lhs.to(dtype), (0, pad))
            rhs = torch.nn.functional.pad(self.rhs.to(dtype), (0, 0, 0, pad))
            self.operands[dtype] = (lhs.contiguous(), rhs.contiguous())
        return self.operands[dtype]

    def linear(self, rows, offsets, is_transposed: bool = False, bias=None) -> torch.Tensor:
        """``_grouped_linear(rows, weight, ...)`` for the folded weight [experts, a, b] (rows
        @ weight[e].T, or rows @ weight[e] where transposed), without forming it."""
        from transformers.integrations.moe import _grouped_linear

        lhs, rhs = self.factors(rows.dtype)
        out = _grouped_linear(rows, self.base.to(rows.dtype), offsets, bias, is_transposed)
        if is_transposed:  # rows @ (base + s lhs @ rhs) = rows @ base + s (rows @ lhs) @ rhs
            low = _grouped_linear(
                _grouped_linear(rows, lhs, offsets, is_transposed=True),
                rhs,
                offsets,
                is_transposed=True,
            )
        else:  # rows @ (base + s lhs @ rhs).T = rows @ base.T + s (rows @ rhs.T) @ lhs.T
            low = _grouped_linear(_grouped_linear(rows, rhs, offsets), lhs, offsets)
        return out.add_(low, alpha=self.scaling)

    def factor_grads(self, grad_rows, input_rows, offsets, transposed: bool) -> tuple:
        """``(grad of lhs, grad of rhs)`` for the projection ``input_rows -> grad_rows``'s
        side: the weight's gradient would be ``left.T @ right`` per expert (grad.T @ input, or
        input.T @ grad where the layout is transposed), so lhs takes ``s left.T @ (right @
        rhs.T)`` and rhs ``s (left @ lhs).T @ right``."""
        from transformers.integrations.moe import _grouped_linear

        left, right = (input_rows, grad_rows) if transposed else (grad_rows, input_rows)
        lhs, rhs = self.factors(left.dtype)
        right_rhs = _grouped_linear(right, rhs, offsets).mul_(self.scaling)
        left_lhs = _grouped_linear(left, lhs, offsets, is_transposed=True).mul_(self.scaling)
        grad_lhs = expert_weight_grads(left, right_rhs, offsets, lhs)[..., : self.rank]
        grad_rhs = expert_weight_grads(left_lhs, right, offsets, rhs)[:, : self.rank]
        return grad_lhs.to(self.lhs.dtype), grad_rhs.to(self.rhs.dtype)


def grouped_linear(rows, weight, offsets, is_transposed: bool = False, bias=None):
    """transformers' ``_grouped_linear`` in ``rows``' dtype, for a weight kept whole or as
    :class:`LowRankWeight`."""
    from transformers.integrations.moe import _grouped_linear

    if isinstance(weight, LowRankWeight):
        return weight.linear(rows, offsets, is_transposed, bias)
    return _grouped_linear(rows, weight.to(rows.dtype), offsets, bias, is_transposed)


def op_weights(module, names: tuple, weights: tuple, state) -> tuple[tuple, tuple]:
    """``(weights, refolds)`` for an experts op over ``module``'s weights ``names`` (read once
    by the caller: ``weights``): how to rebuild each in backward (:func:`refolded`), and the
    weights as the op takes them, detached from PEFT's fold where it takes one as base plus a
    rank-r path. The op gives the factors their gradients itself and the merged weight none, so
    nothing needs the fold's graph; attached, it lived until backward with what it saved (the
    factors, :func:`_factors_again`)."""
    refolds = tuple(refolded(module, name, state.lora_wrappers) for name in names)
    weights = tuple(
        weight.detach() if refold is not None and refold.low_rank() is not None else weight
        for weight, refold in zip(weights, refolds)
    )
    return weights, refolds


def factor_inputs(refolds: tuple) -> tuple:
    """``(lhs, rhs)`` of each weight kept as :class:`LowRankWeight`, ``(None, None)`` for the
    others, flat: the op takes them as inputs, to return their gradients."""
    parts = (None if refold is None else refold.low_rank() for refold in refolds)
    return tuple(x for part in parts for x in ((None, None) if part is None else part[1:3]))


def keep_input(ctx, state, hidden_states: torch.Tensor, weight_inputs: tuple) -> tuple:
    """What an experts op saves of its input, to append last to what it saves (and
    :func:`kept_input` takes back): nothing where neither the first projection's weight nor its
    LoRA factors (``weight_inputs``: their positions among the op's inputs) take a gradient,
    since the input's own gradient needs only the weights (frozen experts, LoRA on attention
    alone, kept ``tokens x hidden`` a layer for nothing); else the input packed into the
    state's ``input`` slot where it has one (a linear layer's input: the router's linear packs
    the same tensor, and they share the pack), or as it is. A torch.compile trace keeps it
    whatever (its backward forms the input's and the weight's gradients in one operator)."""
    ctx.input_shape, ctx.input_header, ctx.n_input = hidden_states.shape, None, 0
    if not torch.compiler.is_compiling() and not any(
        ctx.needs_input_grad[i] for i in weight_inputs
    ):
        return ()
    kept = (hidden_states,)
    if state.codecs.get("input") is not None:
        packed = state.pack(hidden_states, "input", linear_input=True)
        ctx.input_header, kept = packed.with_tensors(()), packed.tensors
    ctx.n_input = len(kept)
    return kept


def kept_input(ctx, saved: tuple) -> tuple[tuple, functools.partial]:
    """``(saved without the input's tensors, load)``: ``load()`` returns what
    :func:`keep_input` kept (unpacked; an empty tensor where it kept nothing), called where the
    backward uses it, so that an unpacked copy lives only from there on."""
    count = ctx.n_input
    kept = saved[len(saved) - count :] if count else ()
    return saved[: len(saved) - count], functools.partial(_load_input, ctx.input_header, kept)


def _load_input(header, kept: tuple) -> torch.Tensor:
    if not kept:
        return torch.empty(0)
    return kept[0] if header is None else header.with_tensors(kept).unpack()


def input_rows(ctx, load, token_of_row: torch.Tensor, dtype) -> torch.Tensor:
    """The kept input (``load``: from :func:`kept_input`) gathered per routed row, in
    ``dtype``; zeros where :func:`keep_input` kept none (a backward traced apart from its
    forward, as compiled autograd traces it: only the frozen weight's discarded gradient reads
    them)."""
    hidden = load()
    if hidden.numel() == 0 and ctx.input_shape.numel() != 0:
        rows = (token_of_row.numel(), ctx.input_shape[-1])
        return torch.zeros(rows, dtype=dtype, device=token_of_row.device)
    return hidden[token_of_row].to(dtype)


def keep_weights(ctx, weights: tuple, refolds: tuple) -> tuple:
    """What an op saves for ``weights`` (an empty stand-in where it can rebuild one), then for
    each the frozen base and factors of a :class:`LowRankWeight` (Nones for the others); the
    rest of how to rebuild them goes on ``ctx``."""
    parts = [None if refold is None else refold.low_rank() for refold in refolds]
    ctx.refolds = tuple(None if part else refold for part, refold in zip(parts, refolds))
    ctx.scalings = tuple(part[3] if part else None for part in parts)
    # The factors made again in backward where the refold knows how, else kept.
    ctx.factors = tuple(None if refold is None else refold.factors for refold in refolds)
    kept = tuple(
        weight if refold is None or weight is None else weight.new_empty(0)
        for weight, refold in zip(weights, refolds)
    )
    low_rank = []
    for part, again in zip(parts, ctx.factors):
        low_rank += (None,) * 3 if not part else (part[0], None, None) if again else part[:3]
    return kept + tuple(low_rank)


def kept_weights(ctx, saved: tuple, low_rank: tuple) -> tuple:
    """The weights :func:`keep_weights` kept: as saved, folded again, or a
    :class:`LowRankWeight` (``low_rank``: the three saved tensors per weight it appended)."""
    weights = []
    for i, (weight, refold, scaling) in enumerate(zip(saved, ctx.refolds, ctx.scalings)):
        if scaling is not None:
            base, lhs, rhs = low_rank[3 * i : 3 * i + 3]
            if ctx.factors[i] is not None:
                lhs, rhs = ctx.factors[i]()
            weights.append(LowRankWeight(base, lhs, rhs, scaling))
        else:
            weights.append(refold() if refold is not None else weight)
    return tuple(weights)


def weight_grads(weight, grad_rows, input_rows, offsets, transposed: bool) -> tuple:
    """``(the weight's gradient, its factors' gradients)``: the full gradient in the weight's
    layout ([experts, out, in], or [experts, in, out] where transposed) for a weight kept
    whole, ``(None, (grad of lhs, grad of rhs))`` for a :class:`LowRankWeight`."""
    if isinstance(weight, LowRankWeight):
        return None, weight.factor_grads(grad_rows, input_rows, offsets, transposed)
    if transposed:
        return expert_weight_grads(input_rows, grad_rows, offsets, weight), (None, None)
    return expert_weight_grads(grad_rows, input_rows, offsets, weight), (None, None)
