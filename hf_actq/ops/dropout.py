"""Dropout whose backward keeps 1 bit per element, or only the RNG seed that made the mask.

``nn.Dropout`` keeps a full-size mask (a byte, or on CPU a whole float, per element). Here the
mask is either packed to 1 bit (``mode="mask"``) or regenerated in backward from a seed drawn from
torch's RNG (``mode="seed"``: 8 bytes in all, one extra random draw in backward; on a GPU a
Triton kernel draws each element's decision from the seed, so not even a transient mask or random
tensor is allocated). Both are exact: backward multiplies by the very mask forward used.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_actq.codecs.packed import capturing_cuda_graph, draw_seed
from hf_actq.kernels import mask_pack, mask_unpack, seeded_dropout
from hf_actq.kernels.dropout import dropout_keep_reference
from hf_actq.ops.state import OpState, once_differentiable, set_state, state_of, wants_backward

MODES = ("seed", "mask")


# The keep-mask a seed stands for (the eager attention op and "mask" mode materialise it).
keep_mask = dropout_keep_reference


def _dropped(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    # The expression of seeded_dropout's twin, so every path agrees bit for bit.
    return x * keep * (1.0 / (1.0 - p))


class CompressedDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, mode, seed, seed_tensor):
        ctx.p, ctx.mode, ctx.shape = p, mode, x.shape
        if mode == "seed":
            # On a GPU the kernel draws each element's decision from the seed: no mask exists.
            ctx.save_for_backward(seed_tensor)
            return seeded_dropout(x, p, seed)
        keep = keep_mask(x.shape, p, seed, x.device)
        ctx.save_for_backward(mask_pack(keep))
        return _dropped(x, keep, p)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        (saved,) = ctx.saved_tensors
        if ctx.mode == "seed":
            return seeded_dropout(grad_y, ctx.p, int(saved.item())), None, None, None, None
        keep = mask_unpack(saved, ctx.shape, torch.bool)
        return _dropped(grad_y, keep, ctx.p), None, None, None, None


class CompressedDropout(nn.Dropout):
    """``nn.Dropout(p)`` keeping a 1-bit mask or a seed for backward (see module docstring)."""

    def __init__(self, p: float = 0.5, mode: str = "seed") -> None:
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be a number in [0, 1], got {p!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        super().__init__(p)
        set_state(self, OpState(plain=nn.Dropout.forward.__get__(self), dropout_mode=mode))

    @property
    def mode(self) -> str:
        return state_of(self).dropout_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0 or torch.compiler.is_compiling() or capturing_cuda_graph(x.device):
            # Under torch.compile the seed cannot be read in the trace: stock dropout, whose
            # mask the compiler keeps (or regenerates, on CUDA) as it chooses. Captured into a
            # CUDA graph, a seed drawn on the host would give every replay the capture's mask;
            # stock dropout draws from the CUDA generator, which each replay advances.
            return state_of(self).plain(x)
        state = state_of(self)
        if not wants_backward(self, x):
            # What the Function would compute, from the same single seed draw.
            if state.dropout_mode != "seed":
                return _dropped(x, keep_mask(x.shape, self.p, draw_seed(), x.device), self.p)
            seed = draw_seed()
            y = seeded_dropout(x, self.p, seed)
            if state.offer_output and torch.is_grad_enabled():  # the input of a trained lora_A
                seed_tensor = torch.tensor([seed], dtype=torch.int64, device="cpu")
                state.cache.alias(y, x, float(self.p), seed_tensor)
            return y
        seed = draw_seed()
        seed_tensor = torch.tensor([seed], dtype=torch.int64, device="cpu")
        y = CompressedDropoutFunction.apply(x, float(self.p), state.dropout_mode, seed, seed_tensor)
        if state.offer_output and state.dropout_mode == "seed":
            # PEFT's LoRA dropout: its consumer (lora_A) packs the input instead, shared with
            # the other adapters of that input, and rebuilds the output with this seed.
            state.cache.alias(y, x, float(self.p), seed_tensor)
        return y

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode!r}"
