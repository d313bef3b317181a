"""LayerNorm and RMSNorm that keep a compressed normalized input plus per-row fp32 statistics,
or, as exact memory-sharing norms, their output.

Backward needs ``x_hat = (x - mean) * rstd`` and ``rstd``: the ops keep ``x_hat`` compressed (it
has unit scale per row, which suits any codec) and ``rstd`` in fp32, one value per row. With
``norm_from_output`` (exact recipes; LowMemoryBP's memory-sharing norms) they keep the output
``y`` instead, which the next linear layers keep anyway (the same storage, so no bytes of its
own), and rebuild ``x_hat = (y - bias) / weight`` in backward: the input's copy is freed. That is
exact up to the rounding of ``y`` to the model dtype (fp32: about 1e-7 relative; bf16: one bf16
ulp of ``x_hat``). ``y`` cannot be divided by a zero weight: the column of the smallest weight
keeps its ``x_hat`` beside ``y`` (chosen on the device, without a host sync). The
forward output is the unpatched module's, bit for bit. Neither direction makes a full-size fp32
copy of a half-precision input: forward works a chunk of rows at a time, and backward runs fused
Triton kernels on GPU (``kernels/norm.py``) and a chunked twin elsewhere. With a uniform/AQ codec
on GPU, one kernel computes x_hat from PyTorch's statistics and packs it (an RMSNorm's output
too), and the backward kernels dequantize it themselves: x_hat never exists in memory, with the
composition's bits.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from hf_actq.codecs.average import AverageQuantCodec
from hf_actq.codecs.packed import Codec, Packed, UnpackShare
from hf_actq.kernels import (
    norm_backward,
    norm_backward_from_output,
    norm_backward_packed,
    norm_pack,
)
from hf_actq.kernels.norm import fp32_scale_of, normalized
from hf_actq.kernels.packing import row_chunks
from hf_actq.kernels.registry import runs_kernels
from hf_actq.ops.dedup import may_offer
from hf_actq.ops.state import (
    default_state,
    has_hooks,
    keep_rng_stream,
    kernel_reads,
    once_differentiable,
    packs_in_kernel,
    set_state,
    state_of,
    wants_backward,
)


def _layer_norm_statistics(x, eps):
    """fp32 mean and rstd per row, chunked as above."""
    width = x.shape[-1]
    rows_x = x.reshape(-1, width)
    mean = torch.empty(rows_x.shape[0], 1, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    for rows in row_chunks(rows_x.shape[0], width):
        var, mean[rows] = torch.var_mean(rows_x[rows].float(), dim=-1, keepdim=True, correction=0)
        rstd[rows] = torch.rsqrt(var + eps)
    return mean, rstd


def _rms_rstd(hidden, eps):
    """HF's RMSNorm statistics of fp32 rows."""
    return torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)


def _rms_statistics(x, eps):
    """:func:`_rms_rstd` of ``x``, a chunk of rows at a time."""
    width = x.shape[-1]
    rows_x = x.reshape(-1, width)
    rstd = torch.empty(rows_x.shape[0], 1, dtype=torch.float32, device=x.device)
    for rows in row_chunks(rows_x.shape[0], width):
        rstd[rows] = _rms_rstd(rows_x[rows].to(torch.float32), eps)
    return rstd


# Columns whose x_hat a memory-sharing norm keeps beside its output: those of the smallest
# |weight + offset|, where y / (weight + offset) is undefined (an exact zero) or loses the most.
# Chosen on the device, so that no step waits for the GPU to say whether a trained weight has
# turned zero (a check that cost a sync per norm per optimizer step). One column: a zero that
# training makes is one weight reaching 0.0 exactly; a norm whose weight has more zeros when it
# is patched (a zero-initialised one) keeps x_hat instead (``shares_output``).
GUARD_COLUMNS = 1


def shares_output(weight: torch.Tensor | None, offset: float = 0.0) -> bool:
    """Whether a memory-sharing norm with ``weight`` can rebuild its input from its output: no
    more zeros in ``weight + offset`` than it keeps guard columns. Read once, when the norm is
    patched."""
    if weight is None or type(weight.data) is not torch.Tensor or weight.device.type == "meta":
        return True  # not readable here (a shard, a meta tensor): the guard column stands
    with torch.no_grad():
        return int((weight.detach() == -offset).sum()) <= GUARD_COLUMNS


def _guard_columns(weight, offset, x_hat_columns):
    """The columns of the smallest ``|weight + offset|`` and ``x_hat`` there (``[rows, K]``)."""
    scale = weight.detach().float()
    scale = scale + offset if offset else scale  # |w + 0| is |w|: one device op fewer
    index = torch.topk(scale.abs(), min(GUARD_COLUMNS, scale.numel()), largest=False).indices
    return index, x_hat_columns(index)


def _layer_norm_columns(x, mean, rstd, index):
    """Columns ``index`` of :func:`normalized`'s ``x_hat``, the same arithmetic."""
    columns = x.reshape(-1, x.shape[-1]).index_select(1, index).float()
    return ((columns - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)).to(x.dtype)


@dataclass(frozen=True)
class NormOutputPacked(Packed):
    """A norm's output rebuilt from the norm's own packed ``x_hat``: ``w * x_hat`` (RMSNorm, in
    ``x_hat``'s dtype as LLaMA's computes it; with ``fp32_scale``, ``x_hat * (w + offset)`` in
    fp32: Gemma's, offset 1, OLMo-2's and gpt-oss's, offset 0) or
    ``x_hat * w + b`` (LayerNorm, in fp32). ``tensors``
    are the source's buffers, then copies of the weight and bias (hidden-sized), which the norm
    saves in place of the parameters themselves (see :func:`_keep`).

    A compressed norm offers it to the ops that consume its output (the next linear layers), so
    the output is not packed a second time; its error is the weight times that of ``x_hat``.
    """

    source: Packed | None = None  # the packed x_hat, without its tensors
    rms: bool = False
    has_weight: bool = True
    has_bias: bool = False
    offset: float = 0.0
    fp32_scale: bool = False

    @property
    def nbytes(self) -> int:
        return self.source.with_tensors(self.tensors[: self._split]).nbytes

    @property
    def sources(self) -> tuple[Packed, ...]:
        """The packs it is rebuilt from (headers)."""
        return (self.source,)

    @property
    def _split(self) -> int:
        return len(self.tensors) - self.has_weight - self.has_bias

    def _unpack(self) -> torch.Tensor:
        split = self._split
        x_hat = self.source.with_tensors(self.tensors[:split]).unpack()
        weight = self.tensors[split] if self.has_weight else None
        bias = self.tensors[-1] if self.has_bias else None
        if self.rms and self.fp32_scale:
            y = x_hat.float() * fp32_scale_of(weight, self.offset)
        elif self.rms:
            y = x_hat.to(self.source.dtype)
            y = y if weight is None else weight * y
        else:
            y = x_hat.float()
            y = y if weight is None else y * weight.float()
            y = y if bias is None else y + bias.float()
        return y.to(self.dtype)


def _keep(ctx, state, x_hat_of, y, weight, bias, rstd, x_hat_columns, rms=False, packed=None):
    """Save what backward needs: ``y`` (memory sharing) and the guard columns of ``x_hat``
    (``x_hat_columns(index)``), else ``x_hat`` packed by the slot's codec (``packed``, where a
    kernel packed it already), or exact when the norm has no codec."""
    ctx.offset = offset = state.norm_offset
    # Under torch.compile x_hat is kept: the trace holds no cache for the shared output.
    ctx.from_output = state.norm_from_output and not torch.compiler.is_compiling()
    if ctx.from_output:
        ctx.path = state.path
        guard = () if weight is None else _guard_columns(weight, offset, x_hat_columns)
        ctx.save_for_backward(rstd, weight, bias, y, *guard)
        return
    codec = state.codecs.get("input")
    if codec is None:
        ctx.header = None
        ctx.save_for_backward(rstd, weight, bias, x_hat_of())
        return
    if packed is None:
        packed = state.pack(x_hat_of(), "input")
    ctx.header = packed.with_tensors(())
    if may_offer(state):
        # Copies, kept alive by this norm's own saved tensors: the consumers (in BERT the next
        # layer's q, k, v) run their backward before this norm's module, and FSDP2 frees a
        # module's unsharded parameters between its forward and its backward; its default
        # backward prefetch gathers them again in time, other settings need not (the norm's
        # backward reads only the values).
        weight, bias = (None if t is None else t.clone() for t in (weight, bias))
        rebuilt = NormOutputPacked(
            codec=packed.codec,
            shape=y.shape,
            dtype=y.dtype,
            tensors=(*packed.tensors, *(t for t in (weight, bias) if t is not None)),
            source=packed.with_tensors(()),
            rms=rms,
            has_weight=weight is not None,
            has_bias=bias is not None,
            offset=offset,
            fp32_scale=state.norm_fp32_scale,
        )
        entry = state.cache.offer(y, rebuilt, state.slot_id("input"))
        if state.record_offer:
            state.offered = entry
    ctx.save_for_backward(rstd, weight, bias, *packed.tensors)


def _kernel_codec(state, x) -> AverageQuantCodec | None:
    """The slot's codec where one kernel normalizes ``x`` and packs ``x_hat``
    (``hf_actq::norm_pack``, the same bits as the composition); None where the composition runs:
    a memory-sharing norm (it keeps its output), a slot that is not uniform/AQ, a
    non-contiguous input, groups that do not divide the width, an observer watching the packs
    (measurement and calibration see every tensor packed), a trace, or no kernel to run (CPU:
    the twin would be that very composition)."""
    codec = state.codecs.get("input")
    if state.norm_from_output or not x.is_contiguous() or not packs_in_kernel(x, (codec,)):
        return None
    return codec


def _kernel_pack(state, codec, x, mean, rstd, weight=None):
    """``(y, packed x_hat)`` from ``hf_actq::norm_pack`` (``y``: an RMSNorm's output in the
    state's form, given its ``weight``), with the seed and the share ``state.pack`` would give
    the pack."""
    seed = state.cache.seed_for(codec, state.slot_id("input")) or 0
    layout = [codec.bits, codec.group_size, codec.block_size, int(codec.stochastic)]
    offset, fp32_scale = state.norm_offset, state.norm_fp32_scale
    y, *buffers = norm_pack(x, mean, rstd, weight, offset, fp32_scale, layout, seed)
    packed = Packed(codec, x.shape, x.dtype, tuple(buffers))
    object.__setattr__(packed, "_share", UnpackShare(consumers=1))
    return y, packed


def _without_sharing_under_hooks(module: nn.Module, state):
    """A norm with forward hooks keeps its normalized input, not its output: a hook may change
    the output in place (an exact norm's backward rebuilds the input from it)."""
    if state.norm_from_output and has_hooks(module):
        return dataclasses.replace(state, norm_from_output=False)
    return state


def _norm_grads(ctx, grad_y, centered):
    """``(grad_x, grad_w, grad_b)`` (fp32 parameter gradients) and the weight, from what the
    forward kept: the output of a memory-sharing norm (x_hat rebuilt inside the backward
    kernels), x_hat, or its pack (dequantized inside them, :func:`_dequantized_in_kernel`)."""
    try:
        rstd, weight, bias, *buffers = ctx.saved_tensors
    except RuntimeError as error:
        if not ctx.from_output or "inplace" not in str(error):
            raise
        raise RuntimeError(
            f"hf_actq: the output of {ctx.path or 'a norm'} was changed in place after its "
            "forward, and its memory-sharing backward rebuilds the input from it: pass "
            "ActQConfig(share_norm_outputs=False) (or change a copy of the output)"
        ) from None
    if ctx.from_output:
        y, *guard = buffers
        index, columns = guard if weight is not None else (None, None)
        args = (grad_y, y, weight, bias, index, columns, rstd, centered, ctx.offset)
        return norm_backward_from_output(*args), weight
    if ctx.header is None:
        x_hat = buffers[0]
    else:
        packed = ctx.header.with_tensors(buffers)
        x_hat = packed if _dequantized_in_kernel(packed, grad_y) else packed.unpack()
    return _norm_backward(grad_y, x_hat, rstd, weight, centered, ctx.offset), weight


def _dequantized_in_kernel(packed: Packed, grad_y: torch.Tensor) -> bool:
    """Whether ``hf_actq::norm_backward_packed`` takes ``x_hat`` as its pack: a uniform/AQ pack
    in the gradient's dtype whose groups divide the width, kernels that run (CPU: the twin would
    unpack it all the same) and no trace. A pack the norm's output consumers keep too (they take
    the output rebuilt from it) is read as the tensor one of them unpacked already, else the
    norm leaves the share and reads the packed buffers."""
    if (
        not kernel_reads(packed, grad_y)
        or not runs_kernels(grad_y)
        or torch.compiler.is_compiling()
    ):
        return False
    share = packed._share
    if share is not None and share.consumers > 1:
        if share.value is not None:
            return False
        share.leave()
    return True


def _norm_backward(grad_y, x_hat, rstd, weight, centered, offset=0.0):
    if isinstance(x_hat, Packed):
        codec = x_hat.codec
        layout = [codec.bits, codec.group_size, codec.block_size]
        args = (rstd, weight, centered, offset)
        return norm_backward_packed(grad_y, *x_hat.tensors, layout, *args)
    return norm_backward(grad_y, x_hat, rstd, weight, centered, offset)


class CompressedLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, state):
        width = x.shape[-1]
        y, mean, rstd = torch.native_layer_norm(x, (width,), weight, bias, eps)
        if rstd.dtype != torch.float32:
            # Some backends return half-precision statistics; backward wants fp32 ones.
            mean, rstd = _layer_norm_statistics(x, eps)
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        codec = _kernel_codec(state, x)
        packed = None if codec is None else _kernel_pack(state, codec, x, mean, rstd)[1]
        _keep(
            ctx,
            state,
            lambda: normalized(x, mean, rstd)[0],
            y,
            weight,
            bias,
            rstd,
            lambda index: _layer_norm_columns(x, mean, rstd, index),
            packed=packed,
        )
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        (grad_x, grad_w, grad_b), weight = _norm_grads(ctx, grad_y, True)  # centered
        grad_w = grad_w.to(weight.dtype) if ctx.has_weight else None
        grad_b = grad_b.to(grad_y.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


class CompressedRMSNormFunction(torch.autograd.Function):
    """HF's RMSNorm (LLaMA, Mistral, Qwen): ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``;
    with ``state.norm_fp32_scale``, ``(x * rsqrt(mean(x^2) + eps) * (w + offset))`` in fp32,
    then cast: Gemma's (``state.norm_offset`` 1), OLMo-2's and gpt-oss's (0). Backward is the
    same with ``w + offset`` for ``w``."""

    @staticmethod
    def forward(ctx, x, weight, eps, state):
        # HF's arithmetic row by row (the same bits), a chunk of rows at a time: HF makes three
        # full-size fp32 temporaries of a half-precision input here.
        offset, fp32_scale = state.norm_offset, state.norm_fp32_scale
        # Without a weight (a scale-free norm) y is x_hat itself: the composition keeps it.
        codec = None if weight is None else _kernel_codec(state, x)
        if codec is not None:  # the statistics here, then x_hat's pack and y in one kernel
            rstd = _rms_statistics(x, eps)
            y, packed = _kernel_pack(state, codec, x, None, rstd, weight)
            _keep(ctx, state, None, y, weight, None, rstd, None, rms=True, packed=packed)
            return y
        width = x.shape[-1]
        rows_x = x.reshape(-1, width)
        normed = torch.empty(rows_x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows_x.shape[0], 1, dtype=torch.float32, device=x.device)
        y = torch.empty(rows_x.shape, dtype=x.dtype, device=x.device) if fp32_scale else None
        scale = None if y is None else fp32_scale_of(weight, offset)
        for rows in row_chunks(rows_x.shape[0], width):
            hidden = rows_x[rows].to(torch.float32)
            rstd[rows] = _rms_rstd(hidden, eps)
            if fp32_scale:  # Gemma, OLMo-2 and gpt-oss scale in fp32 and cast the product
                hidden = hidden * rstd[rows]
                normed[rows] = hidden
                y[rows] = hidden * scale
            else:
                normed[rows] = hidden * rstd[rows]
        normed = normed.view(x.shape)
        if fp32_scale:
            y = y.view(x.shape)
        elif weight is None:  # a scale-free norm: its output is x_hat
            y = normed
        else:
            y = weight * normed
        columns = lambda index: normed.reshape(-1, width).index_select(1, index)
        _keep(ctx, state, lambda: normed, y, weight, None, rstd, columns, rms=True)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        # Gemma's scale, 1 + w, is added in fp32 by the kernels (not a tensor of its own).
        (grad_x, grad_w, _), weight = _norm_grads(ctx, grad_y, False)
        return grad_x, None if weight is None else grad_w.to(weight.dtype), None, None


SLOTS = ("input",)


def rms_norm_eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return None if eps is None else float(eps)


# The RMSNorm forms hf_actq computes, as (offset, fp32 scale): LLaMA's
# ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``; Gemma's ``(x * rsqrt(...) * (1 + w))`` in fp32,
# then cast; OLMo-2's and gpt-oss's ``(w * x * rsqrt(...))`` in fp32, then cast.
LLAMA_FORM, GEMMA_FORM, FP32_SCALE_FORM = (0.0, False), (1.0, True), (0.0, True)


def rms_norm_form(
    module: nn.Module, input_dtype: torch.dtype | None = None, device=None
) -> tuple[float, bool] | None:
    """The form ``module`` computes (``LLAMA_FORM``, ``GEMMA_FORM`` or ``FP32_SCALE_FORM``), or
    None for anything else. Checked bit for bit on a random input of ``input_dtype`` (default:
    the weight's) with a random weight of the weight's dtype: forms that agree in one precision
    can differ in another (OLMo-2's is LLaMA's in fp32 only), so a patched norm checks again for
    each dtype it meets.

    The module's own parameters are not used (under FSDP2 they are DTensor shards, and an
    all-ones weight would not tell ``w`` from ``1 + w`` apart), its hooks do not run, and the
    global RNG is left alone (moving it would change, e.g., LoRA weights initialised after
    patching).
    """
    eps = rms_norm_eps(module)
    weight = getattr(module, "weight", None)
    if weight is None:
        return _scale_free_form(module, eps, input_dtype or torch.float32, device)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    generator = torch.Generator().manual_seed(0)
    sample, probe_weight = (
        torch.randn(shape, generator=generator, device="cpu").to(dtype).to(weight.device)
        for shape, dtype in (
            ((3, weight.shape[0]), input_dtype or weight.dtype),
            ((weight.shape[0],), weight.dtype),
        )
    )
    probe = copy.copy(module)
    probe._parameters = {**module._parameters, "weight": probe_weight}
    with torch.no_grad():
        got = type(module).forward(probe, sample)
        hidden = sample.float()
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        if torch.equal(got, probe_weight * normed.to(sample.dtype)):
            return LLAMA_FORM
        if torch.equal(got, (normed * (1.0 + probe_weight.float())).to(sample.dtype)):
            return GEMMA_FORM
        if torch.equal(got, (normed * probe_weight.float()).to(sample.dtype)):
            return FP32_SCALE_FORM
    return None


def _scale_free_form(module, eps, dtype, device) -> tuple[float, bool] | None:
    """LLaMA's form without a weight, ``(x * rsqrt(mean(x^2) + eps)).to(dtype)`` (Gemma 4's
    ``v_norm``), where a module with no parameters of its own computes it bit for bit on a
    random input of ``dtype`` on ``device`` (default the CPU); else None."""
    if eps is None or any(True for _ in module.parameters(recurse=False)):
        return None
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn((3, 64), generator=generator).to(dtype).to(device or "cpu")
    with torch.no_grad():
        got = type(module).forward(module, sample)
        hidden = sample.float()
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        if isinstance(got, torch.Tensor) and torch.equal(got, normed.to(sample.dtype)):
            return LLAMA_FORM
    return None


class CompressedLayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` over the last dimension sharing the parameters of ``norm``;
    ``share_output=True`` keeps the output instead of the packed input (see the module)."""

    def __init__(
        self, norm: nn.LayerNorm, codec: Codec | None = None, cache=None, share_output=False
    ) -> None:
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise ValueError("CompressedLayerNorm wraps an nn.LayerNorm over the last dimension")
        nn.Module.__init__(self)
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.elementwise_affine = norm.elementwise_affine
        self.weight, self.bias = norm.weight, norm.bias
        state = default_state(nn.LayerNorm.forward.__get__(self), codec, cache, SLOTS)
        state.norm_from_output = share_output and shares_output(norm.weight)
        set_state(self, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = state_of(self)
        if not wants_backward(self, x, self.weight, self.bias):
            keep_rng_stream(self, *state.codecs.values())
            return state.plain(x)
        state = _without_sharing_under_hooks(self, state)
        return CompressedLayerNormFunction.apply(x, self.weight, self.bias, self.eps, state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, codec={state_of(self).codecs.get('input')!r}"


class CompressedRMSNorm(nn.Module):
    """An RMSNorm sharing the weight of ``norm``: LLaMA's
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (Llama, Mistral, Qwen), Gemma's
    ``(1 + weight)`` form computed in fp32, or OLMo-2's and gpt-oss's ``weight`` applied in fp32,
    whichever ``norm`` computes (checked bit for bit when built)."""

    def __init__(
        self, norm: nn.Module, codec: Codec | None = None, cache=None, share_output=False
    ) -> None:
        if rms_norm_eps(norm) is None or not isinstance(
            getattr(norm, "weight", None), torch.Tensor
        ):
            raise ValueError(
                f"CompressedRMSNorm needs a module with weight and variance_epsilon (or eps), "
                f"got {type(norm).__name__}"
            )
        form = rms_norm_form(norm)
        if form is None:
            raise ValueError(
                f"CompressedRMSNorm: {type(norm).__name__} computes none of LLaMA's RMSNorm "
                "weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), Gemma's (1 + weight) form "
                "and OLMo-2's weight applied in fp32; keep it as it is"
            )
        super().__init__()
        self.weight = norm.weight
        offset, fp32_scale = form
        state = default_state(
            norm.forward,
            codec,
            cache,
            SLOTS,
            eps=rms_norm_eps(norm),
            norm_offset=offset,
            norm_fp32_scale=fp32_scale,
        )
        state.norm_forms[(norm.weight.dtype, norm.weight.dtype)] = form
        state.norm_from_output = share_output and shares_output(norm.weight, offset)
        set_state(self, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = state_of(self)
        weight = getattr(self, "weight", None)  # none on a scale-free norm
        if not wants_backward(self, x, weight):
            keep_rng_stream(self, *state.codecs.values())
            return state.plain(x)
        form = _form_for(self, state, x)
        if form is None:  # in these dtypes the module computes another form: stock
            return state.plain(x)
        if form != (state.norm_offset, state.norm_fp32_scale):
            state = dataclasses.replace(state, norm_offset=form[0], norm_fp32_scale=form[1])
        state = _without_sharing_under_hooks(self, state)
        return CompressedRMSNormFunction.apply(x, weight, state.eps, state)

    def extra_repr(self) -> str:
        state = state_of(self)
        return f"eps={state.eps}, codec={state.codecs.get('input')!r}"


def _form_for(module: nn.Module, state, x: torch.Tensor) -> tuple[float, bool] | None:
    """:func:`rms_norm_form` for this input's and weight's dtypes, checked once per pair (the
    one it was patched in is known): a model cast after ``apply`` keeps its own form. A
    scale-free norm's float dtypes are known from when it was patched; another dtype is checked
    on the input's device (a weighted norm's on its weight's)."""
    weight = getattr(module, "weight", None)
    key = (x.dtype, None if weight is None else weight.dtype)
    if key not in state.norm_forms:
        device = x.device if weight is None else None
        state.norm_forms[key] = rms_norm_form(module, x.dtype, device)
    return state.norm_forms[key]


__all__ = [
    "CompressedLayerNorm",
    "CompressedLayerNormFunction",
    "CompressedRMSNorm",
    "CompressedRMSNormFunction",
]
