"""Activation checkpointing whose kept layer inputs are packed.

HF's gradient checkpointing keeps each checkpointed layer's input (the hidden states, ``hidden``
values per token) at full precision and recomputes the layer in backward. Here that input is
kept packed by a codec (uniform stochastic rounding at 4 bits keeps 8x less than fp32) and the
recompute runs from the unpacked copy. The forward is exact (it runs on the real input); the
backward is the exact backward of the layer evaluated at the rounded input, given the real
output gradient, so every tensor the layer's backward reads (norm inputs, attention operands,
activations, linear inputs) carries the error of one rounding of the layer's input, never a
rounding of its own: the tensors on the backward's chain, which compound their noise through the
layers below when each is rounded to a bit or two (docs/reference.md, "ALAM as published"),
see 4-bit quality here while the whole layer keeps ``hidden * bits / 8`` bytes per token.

The first pass runs under ``no_grad`` and the backward recomputes the layer with the RNG and
autocast state of the first pass (as ``torch.utils.checkpoint``'s reentrant variant does), so
dropout masks match. Unlike that variant, tensors given as keyword arguments (T5's position
bias, which the first layer computes with a gradient) are inputs of the node and get their
gradients, and a layer whose inputs need no gradient (the first layer of a LoRA model with
frozen embeddings) still trains its parameters.

Under torch.compile a layer that draws no random numbers takes a traced form
(:class:`TracedPackedCheckpointFunction`): its parameters are inputs of the node and backward
differentiates the layer with ``torch.func.vjp``, so the layer compiles into the model's graph
with no break. A layer with dropout keeps the eager form there (a graph break per layer): a
traced recompute cannot replay the first pass's random numbers. The exception is PEFT's LoRA
dropout (:func:`make_dropouts_replayable`): under the traced form each ``lora_dropout`` draws
its mask from a counter hash of a key the node takes as an input, so the recompute redraws the
very mask, and a LoRA layer with ``lora_dropout > 0`` compiles whole.

A layer that routes tokens among experts (a mixture of experts' router) would route the rounded
input differently from the real one for tokens near a tie, and its backward would then train
experts the forward never ran (on a tiny Qwen3-MoE under LoRA, 4 bits took the experts' adapters'
gradients to a cosine of 0.75-0.94 with stock). So the first pass records every ``topk`` and
``argmax`` the layer computes (:class:`SelectionRecorder`; the indices kept in the smallest
integer type that holds them: a byte per choice up to 256 experts) and the recompute replays
them (:class:`SelectionReplay`): the same experts, with the router's weights taken at the
rounded input, as stock checkpointing's recompute routes as its forward did.

HF calls ``layer._gradient_checkpointing_func(partial(forward, layer, **kwargs), *args)``;
:func:`packed_checkpoint` has that signature, with the codec and the layer's
:class:`Reparametrized` bound by ``functools.partial``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from hf_actq.codecs.packed import Codec
from hf_actq.kernels.compiled import uniform_noise
from hf_actq.ops.dedup import PackCache, traced_pack
from hf_actq.ops.state import once_differentiable

REPLAY_KEY = "hf_actq_replay_key"


_TOPK = (torch.topk, torch.Tensor.topk)
_ARGMAX = (torch.argmax, torch.Tensor.argmax)


def _narrowest(indices: torch.Tensor, size: int) -> torch.Tensor:
    """``indices`` (into a dimension of ``size``) in the smallest integer type that holds them."""
    for dtype, limit in ((torch.uint8, 255), (torch.int16, 2**15 - 1), (torch.int32, 2**31 - 1)):
        if size - 1 <= limit:
            return indices.to(dtype)
    return indices


def _topk_dim(args, kwargs) -> int:
    # torch.topk(input, k, dim=-1, largest=True, sorted=True), as a function or a method.
    return args[2] if len(args) > 2 else kwargs.get("dim", -1)


class SelectionRecorder(TorchFunctionMode):
    """Runs a checkpointed layer's first pass as it is, noting the indices of every ``topk`` and
    ``argmax`` it computes (its router's choices), in the order it computes them."""

    def __init__(self):
        super().__init__()
        self.choices: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _TOPK:
            size = args[0].shape[_topk_dim(args, kwargs)] if args[0].dim() else 1
            self.choices.append(_narrowest(out.indices, size))
        elif func in _ARGMAX:
            self.choices.append(_narrowest(out, max(args[0].numel(), 1)))
        return out


class SelectionReplay(TorchFunctionMode):
    """Runs a checkpointed layer's recompute with the choices its first pass made: each
    ``topk`` returns the recorded indices and the recompute's values at them (the router's
    weights stay differentiable), each ``argmax`` the recorded index."""

    def __init__(self, choices):
        super().__init__()
        self.choices = list(choices)
        self.next = 0

    def _take(self, func, shape) -> torch.Tensor:
        if self.next == len(self.choices):
            raise RuntimeError(
                f"a checkpointed layer's recompute called {func.__name__} more often than its "
                f"first pass ({len(self.choices)} choices recorded): a layer whose routing "
                "depends on more than its inputs cannot be recomputed with its choices replayed"
            )
        chosen = self.choices[self.next].long()
        self.next += 1
        if chosen.shape != shape:
            raise RuntimeError(
                f"a checkpointed layer's recompute chose {tuple(shape)} in its "
                f"{func.__name__} #{self.next}, where its first pass chose {tuple(chosen.shape)}"
            )
        return chosen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            source, dim = args[0], _topk_dim(args, kwargs)
            k = args[1] if len(args) > 1 else kwargs["k"]
            shape = list(source.shape)
            if shape:
                shape[dim] = k
            indices = self._take(func, torch.Size(shape))
            values = source.gather(dim, indices) if source.dim() else source.clone()
            return torch.return_types.topk((values, indices))
        if func in _ARGMAX:
            out = func(*args, **kwargs)  # its shape; the choice is the first pass's
            return self._take(func, out.shape).to(out.device)
        return func(*args, **kwargs)

    def check_done(self):
        if self.next != len(self.choices):
            raise RuntimeError(
                f"a checkpointed layer's recompute made {self.next} of the {len(self.choices)} "
                "choices (topk, argmax) its first pass made"
            )


def routes_tokens(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` holds a mixture of experts (a router or an experts module: an integer
    ``top_k``, ``num_experts_per_tok`` or ``num_experts``), whose choices the recompute replays.
    Other layers run without the modes (each adds a Python call to every torch call)."""
    names = ("top_k", "num_experts_per_tok", "num_experts")
    return any(
        isinstance(getattr(module, name, None), int) and not isinstance(getattr(module, name), bool)
        for module in layer.modules()
        for name in names
    )


class _Call:
    """One checkpointed call: the function and its non-tensor arguments, and after the first
    pass how to rebuild its output."""

    def __init__(self, func, leaves, spec, tensor_index, packed_index, codec, pack=None):
        # The tensors are the node's inputs, never held here: a reference to the layer's input
        # would keep it at full precision until backward, as stock checkpointing does.
        self.func, self.spec = func, spec
        self.leaves = [None if i in tensor_index else leaf for i, leaf in enumerate(leaves)]
        self.tensor_index = tensor_index  # leaf positions of the node's tensor inputs
        self.packed_index = packed_index  # position among those of the packed input, or None
        self.codec = codec
        self.pack = pack  # packs the input in place of ``codec.pack`` (through a pack cache)
        self.replays_choices = False  # whether the recompute replays the first pass's topk
        self.out_spec = self.out_leaves = self.out_tensor_index = None

    def run(self, tensors):
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_index, tensors, strict=True):
            leaves[position] = tensor
        args, call_args, kwargs = tree_unflatten(leaves, self.spec)
        return self.func(*args, *call_args, **kwargs)


class PackedCheckpointFunction(torch.autograd.Function):
    """``call.run(tensors)`` keeping ``tensors[call.packed_index]`` packed and nothing of the
    layer's own; backward recomputes the layer from the unpacked copy. The inputs are the
    call's ``n_inputs`` tensors, then the layer's parameters that ``wrapper`` (a
    :class:`Reparametrized`) swaps for ``names`` in the recompute, then an empty tensor (see
    :func:`packed_checkpoint`).

    Those parameters get their gradients as outputs of this node, not by accumulation inside
    the recompute: DDP then sees them used by the step (with ``find_unused_parameters=True``,
    which Trainer picks when checkpointing was off at its start, it would otherwise take them
    for unused and fail when their gradients came) and each gradient arrives once, even for a
    parameter several checkpointed layers share. Parameters the layer reads but ``names`` does
    not list (FSDP2's and ZeRO-3's, which their engines gather into other tensors, or another
    module's) take the recompute's gradient by accumulation, as in torch's reentrant
    checkpoint."""

    @staticmethod
    def forward(ctx, call: _Call, wrapper, names, n_inputs, *tensors):
        inputs = tensors[:n_inputs]
        ctx.call, ctx.wrapper, ctx.names, ctx.n_inputs = call, wrapper, names, n_inputs
        ctx.device_type = torch_checkpoint._infer_device_type(*inputs)
        ctx.autocast = torch_checkpoint._get_autocast_kwargs(ctx.device_type)
        ctx.input_requires_grad = [t.requires_grad for t in inputs]
        kept = list(inputs)
        ctx.header = None
        if call.packed_index is not None:
            source = inputs[call.packed_index]
            if call.pack is not None:
                packed = call.pack(source)
            else:
                # The pack cache's seed: drawn on the device while a CUDA graph is captured.
                seed = PackCache.seed_for(call.codec, None, source.device)
                packed = call.codec.pack(source.detach(), seed)
            ctx.header = packed.with_tensors(())
            ctx.n_packed = len(packed.tensors)
            kept[call.packed_index] = None
            kept = [*packed.tensors, *[t for t in kept if t is not None]]
        # The RNG state after packing: the recompute replays the layer's own draws.
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.device_rng = None
        if getattr(torch_checkpoint._get_device_module(ctx.device_type), "_initialized", False):
            ctx.device_rng = torch_checkpoint.get_device_states(*inputs)
        recorder = SelectionRecorder() if call.replays_choices else contextlib.nullcontext()
        with torch.no_grad(), recorder:
            out = call.run(inputs)
        choices = recorder.choices if call.replays_choices else []
        ctx.n_choices = len(choices)
        outs = _record_outputs(call, out)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        ctx.save_for_backward(*kept, *tensors[n_inputs:-1], *choices)  # the parameters, choices
        return outs

    @staticmethod
    @once_differentiable  # the recompute's own backward builds no graph
    def backward(ctx, *grads):
        call = ctx.call
        saved = list(ctx.saved_tensors)
        choices = saved[len(saved) - ctx.n_choices :]
        saved = saved[: len(saved) - ctx.n_choices]
        if ctx.header is not None:
            buffers, saved = saved[: ctx.n_packed], saved[ctx.n_packed :]
            saved.insert(call.packed_index, ctx.header.with_tensors(buffers).unpack())
        saved, params = saved[: ctx.n_inputs], saved[ctx.n_inputs :]
        inputs = [
            t.detach().requires_grad_(needs) for t, needs in zip(saved, ctx.input_requires_grad)
        ]
        # Stand-ins that share the parameters' storage: the recompute's graph ends in them, not
        # in the parameters' own gradient accumulators (whose hooks DDP and ZeRO listen to).
        stand_ins = [p.detach().requires_grad_() for p in params]
        device_autocast, cpu_autocast = ctx.autocast
        device_context = (
            torch.amp.autocast(device_type=ctx.device_type, **device_autocast)
            if torch.amp.is_autocast_available(ctx.device_type)
            else contextlib.nullcontext()
        )
        devices = ctx.device_rng[0] if ctx.device_rng is not None else []
        replay = SelectionReplay(choices) if call.replays_choices else contextlib.nullcontext()
        with torch.random.fork_rng(devices=devices, device_type=ctx.device_type):
            torch.set_rng_state(ctx.cpu_rng_state)
            if ctx.device_rng is not None:
                torch_checkpoint.set_device_states(*ctx.device_rng, device_type=ctx.device_type)
            with (
                torch.enable_grad(),
                device_context,
                torch.amp.autocast("cpu", **cpu_autocast),
                replay,
            ):
                if stand_ins:
                    given = dict(zip(ctx.names, stand_ins, strict=True))
                    out = torch.func.functional_call(ctx.wrapper, given, (call, inputs))
                else:
                    out = call.run(inputs)
        if call.replays_choices:
            replay.check_done()
        out_leaves, _ = tree_flatten(out)
        outs = [out_leaves[i] for i in call.out_tensor_index]
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if t.requires_grad else None for t in inputs]
        return (None, None, None, None, *input_grads, *[t.grad for t in stand_ins], None)


class Reparametrized(torch.nn.Module):
    """A layer's checkpointed call with its trainable parameters swapped for the tensors
    ``torch.func.functional_call`` gives (the layer is a child, so its names are prefixed with
    ``layer.``), and the replay keys of its replayable dropouts (:func:`make_dropouts_replayable`)
    given. Made when the packed checkpoint function is installed, outside any trace."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer
        replayable = {
            path: module for path, module in layer.named_modules() if REPLAY_KEY in module._buffers
        }
        self.replay_keys = tuple(f"layer.{path}.{REPLAY_KEY}" for path in replayable)
        self.draws_random_numbers = draws_random_numbers(layer, ignore=replayable.values())
        self.routes_tokens = routes_tokens(layer)

    def forward(self, call: _Call, tensors):
        return call.run(tensors)


def draws_random_numbers(layer: torch.nn.Module, ignore=()) -> bool:
    """Whether ``layer`` may draw random numbers in training: a dropout module with ``p > 0``,
    or a positive number under a name with "drop" in it (``attention_dropout``, BART's float
    ``dropout``, ``drop_path`` rates), as HF layers pass to the functional dropouts. Modules in
    ``ignore`` (replayable dropouts) do not count."""
    ignored = {id(module) for module in ignore}
    for module in layer.modules():
        if id(module) in ignored:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        numbers = {
            name: value
            for name, value in vars(module).items()
            if isinstance(value, float | int) and not isinstance(value, bool)
        }
        if any("drop" in name and value > 0 for name, value in numbers.items()):
            return True
    return False


def make_dropouts_replayable(layer: torch.nn.Module):
    """Let the traced form replay ``layer``'s PEFT LoRA dropouts, and return the undo.

    Only dropouts in a ``lora_dropout`` ModuleDict qualify, because PEFT calls them as modules
    on the adapter's input. A dropout elsewhere may only lend its rate to a fused kernel (BERT
    passes ``self.dropout.p`` to SDPA, which draws its own mask), which no module hook sees.
    Each qualifying ``nn.Dropout`` gets an empty int32 buffer (not saved with the weights) and a
    forward that, when the buffer is given a key (only inside the traced form, through
    ``functional_call``), drops by a counter hash of the key; otherwise it is stock dropout."""
    qualifying = [
        module
        for path, module in layer.named_modules()
        if type(module) is torch.nn.Dropout
        and path.rsplit(".", 2)[-2:-1] == ["lora_dropout"]
        and REPLAY_KEY not in module._buffers
    ]
    for module in qualifying:
        module.register_buffer(REPLAY_KEY, torch.empty(0, dtype=torch.int32), persistent=False)
        module.forward = functools.partial(_replayable_dropout, module)

    return functools.partial(_stop_replaying, qualifying)  # not a closure: see patching.py


def _stop_replaying(dropouts: list) -> None:
    for module in dropouts:
        module._buffers.pop(REPLAY_KEY, None)
        module.__dict__.pop("forward", None)


def _replayable_dropout(module: torch.nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    key = module._buffers[REPLAY_KEY]
    if key.numel() == 0 or not module.training or module.p == 0.0:
        return torch.nn.Dropout.forward(module, x)
    if module.p == 1.0:
        return x * 0.0
    if x.numel() >= 2**31:
        raise ValueError(
            f"a LoRA dropout input of {x.numel()} elements is beyond the 2**31 the replayed "
            "mask can index; use a smaller batch, lora_dropout=0, or run without torch.compile"
        )
    index = torch.arange(x.numel(), dtype=torch.int32, device=x.device).view(x.shape)
    keep = uniform_noise(index, key.to(x.device)) >= module.p
    return x * keep * (1.0 / (1.0 - module.p))


class TracedPackedCheckpointFunction(torch.autograd.Function):
    """:class:`PackedCheckpointFunction` in a form a torch.compile trace takes whole: the
    layer's trainable parameters are inputs of the node, and backward computes the layer's
    vector-Jacobian product at the unpacked input with ``torch.func.vjp`` (dynamo traces it,
    where ``torch.autograd.backward`` would break the graph). Used only for layers that draw
    no random numbers (:func:`draws_random_numbers`; a traced recompute cannot replay the
    first pass's RNG) but replayable dropouts, whose masks ``keys`` (one int32 per dropout, or
    None) determine in both passes."""

    @staticmethod
    def forward(ctx, call: _Call, wrapper, names, keys, n_inputs, *tensors):
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.call, ctx.wrapper, ctx.names, ctx.n_inputs = call, wrapper, names, n_inputs
        replay = {} if keys is None else dict(zip(wrapper.replay_keys, keys, strict=True))
        ctx.input_requires_grad = [t.requires_grad for t in inputs]
        kept = list(inputs)
        ctx.header = None
        if call.packed_index is not None:
            packed = traced_pack(inputs[call.packed_index].detach(), call.codec)
            ctx.header = packed.with_tensors(())
            ctx.n_packed = len(packed.tensors)
            kept[call.packed_index] = torch.empty(0)
            kept = [*packed.tensors, *kept]
        recorder = SelectionRecorder() if call.replays_choices else contextlib.nullcontext()
        with torch.no_grad(), recorder:
            out = torch.func.functional_call(wrapper, replay, (call, inputs))
        choices = recorder.choices if call.replays_choices else []
        ctx.n_choices = len(choices)
        outs = _record_outputs(call, out)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        ctx.has_keys = keys is not None
        ctx.save_for_backward(*kept, *params, *choices, *([keys] if ctx.has_keys else []))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        call, n_inputs = ctx.call, ctx.n_inputs
        saved = list(ctx.saved_tensors)
        replay = {}
        if ctx.has_keys:
            replay = dict(zip(ctx.wrapper.replay_keys, saved.pop(), strict=True))
        choices = saved[len(saved) - ctx.n_choices :]
        saved = saved[: len(saved) - ctx.n_choices]
        if ctx.header is not None:
            buffers, saved = saved[: ctx.n_packed], saved[ctx.n_packed :]
            saved[call.packed_index] = ctx.header.with_tensors(buffers).unpack()
        inputs, params = saved[:n_inputs], saved[n_inputs:]
        # The packed input is differentiated whatever it needs: vjp needs one primal per call.
        wanted = [
            i for i, needs in enumerate(ctx.input_requires_grad) if needs or i == call.packed_index
        ]

        def layer(differentiated, params):
            tensors = list(inputs)
            for i, tensor in zip(wanted, differentiated, strict=True):
                tensors[i] = tensor
            given = {**dict(zip(ctx.names, params, strict=True)), **replay}
            chosen = SelectionReplay(choices) if call.replays_choices else contextlib.nullcontext()
            with chosen:
                out = torch.func.functional_call(ctx.wrapper, given, (call, tensors))
            if call.replays_choices:
                chosen.check_done()
            out_leaves, _ = tree_flatten(out)
            return tuple(out_leaves[i] for i in call.out_tensor_index)

        _, pullback = torch.func.vjp(layer, [inputs[i] for i in wanted], params)
        zeros = [torch.zeros_like(g) if g is None else g for g in grads]
        differentiated_grads, param_grads = pullback(tuple(zeros))
        input_grads = [None] * n_inputs
        for i, grad in zip(wanted, differentiated_grads, strict=True):
            input_grads[i] = grad if ctx.input_requires_grad[i] else None
        return (None, None, None, None, None, *input_grads, *param_grads)


def _plain_parameter(p: torch.Tensor) -> bool:
    """A parameter the layer computes with as it is: not FSDP2's DTensor or DeepSpeed ZeRO-3's
    shard, which their engines gather into other tensors for the forward."""
    return not hasattr(p, "_local_tensor") and not hasattr(p, "ds_id")


def _record_outputs(call: _Call, out) -> tuple[torch.Tensor, ...]:
    """Note on ``call`` how to rebuild ``out`` from its tensors, and return them."""
    out_leaves, call.out_spec = tree_flatten(out)
    call.out_tensor_index = [
        i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)
    ]
    call.out_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
    return tuple(out_leaves[i] for i in call.out_tensor_index)


def packed_checkpoint(
    function,
    *args,
    codec: Codec,
    reparametrized: Reparametrized | None = None,
    layer: torch.nn.Module | None = None,
    traceable: bool = True,
    pack=None,
    **kwargs,
):
    """Run ``function(*args, **kwargs)`` keeping only its first positional argument, packed by
    ``codec``, and recompute it in backward (the ``_gradient_checkpointing_func`` of a
    ``GradientCheckpointingLayer``, given as ``layer`` when installed). Under ``no_grad`` it
    just calls ``function``. ``traceable=False`` keeps the eager form under torch.compile;
    ``pack(x)``, where given, packs the first argument instead of ``codec`` (eager form only)."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    func, bound_args, bound_kwargs = function, (), {}
    if isinstance(function, functools.partial):
        func, bound_args = function.func, function.args
        bound_kwargs = {**function.keywords, **kwargs}
    else:
        bound_kwargs = kwargs
    leaves, spec = tree_flatten((bound_args, args, bound_kwargs))
    tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    first = len(tree_flatten(bound_args)[0])  # leaf position of args[0]
    packed_index = None
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        packed_index = tensor_index.index(first)
    tensors = [leaves[i] for i in tensor_index]
    inputs_need_grad = any(t.requires_grad for t in tensors)
    if layer is not None:
        modules = [layer]
    else:
        # Transformers binds the layer as the first argument (before 5.23: a bound method of
        # super(), whose __self__ torch.compile cannot read without a graph break; hence
        # ``layer``), other callers as a bound method.
        owners = (*bound_args, getattr(func, "__self__", None))
        modules = [a for a in owners if isinstance(a, torch.nn.Module)]
    frozen = modules and not any(p.requires_grad for m in modules for p in m.parameters())
    if frozen and not inputs_need_grad:
        return function(*args, **kwargs)  # nothing to keep or recompute
    call = _Call(func, leaves, spec, tensor_index, packed_index, codec, pack)
    call.replays_choices = reparametrized is not None and reparametrized.routes_tokens
    if (
        torch.compiler.is_compiling()
        and traceable
        and pack is None
        and reparametrized is not None
        and modules == [reparametrized.layer]
        and not (reparametrized.draws_random_numbers and modules[0].training)
        and codec.name != "exact"  # (tests only) its unpacked input would alias the saved one
    ):
        trainable = [(name, p) for name, p in modules[0].named_parameters() if p.requires_grad]
        names = tuple("layer." + name for name, _ in trainable)
        keys = None
        if reparametrized.replay_keys and modules[0].training:
            count = len(reparametrized.replay_keys)
            keys = torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32)
        outs = TracedPackedCheckpointFunction.apply(
            call, reparametrized, names, keys, len(tensors), *tensors, *[p for _, p in trainable]
        )
    else:
        if reparametrized is None and len(modules) == 1 and not torch.compiler.is_compiling():
            reparametrized = Reparametrized(modules[0])  # a module is made outside a trace
        listed = []
        if reparametrized is not None and modules == [reparametrized.layer]:
            listed = [
                (name, p)
                for name, p in modules[0].named_parameters()
                if p.requires_grad and _plain_parameter(p)
            ]
        names = tuple("layer." + name for name, _ in listed)
        # Without an input that needs a gradient the node would not exist and the layer's
        # trainable parameters would get none: an empty input that requires grad makes it.
        needs_anchor = not inputs_need_grad and not listed
        anchor = torch.empty(0, requires_grad=needs_anchor)
        outs = PackedCheckpointFunction.apply(
            call, reparametrized, names, len(tensors), *tensors, *[p for _, p in listed], anchor
        )
    out_leaves = list(call.out_leaves)
    for position, tensor in zip(call.out_tensor_index, outs, strict=True):
        out_leaves[position] = tensor
    return tree_unflatten(out_leaves, call.out_spec)
