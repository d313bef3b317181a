"""What every MoE experts op shares: the routed (token, expert) pairs sorted by expert, as
transformers' grouped-matmul experts sort them, the per-token sum back, and the experts' weight
gradients over the routed spans."""

from __future__ import annotations

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
# stay alive anyway, so the ops keep how to fold it again instead.
_FOLDS = ("_LoraFactorsProxy",)


class RefoldedWeight:
    """Rebuilds a parametrized weight, bit for bit, from its original and its folds."""

    def __init__(self, original: torch.Tensor, folds: list) -> None:
        self.original, self.folds = original, folds

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            weight = self.original
            for fold in self.folds:
                weight = fold(weight)
        return weight


def refolded(module, name: str) -> RefoldedWeight | None:
    """How to rebuild ``getattr(module, name)`` in backward, where it is PEFT's LoRA fold of a
    parameter (and not under torch.compile, which traces the fold itself); None otherwise."""
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
    return RefoldedWeight(chain.original, folds)


def keep_weights(weights: tuple, refolds: tuple) -> tuple:
    """What an op saves for ``weights``: an empty stand-in where it can fold one again."""
    return tuple(
        weight if refold is None or weight is None else weight.new_empty(0)
        for weight, refold in zip(weights, refolds)
    )


def kept_weights(saved: tuple, refolds: tuple) -> tuple:
    """The weights :func:`keep_weights` kept, folded again where they were left out."""
    return tuple(
        refold() if refold is not None else weight for weight, refold in zip(saved, refolds)
    )
