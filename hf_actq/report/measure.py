"""Memory reports: one training step of a model per recipe, measured side by side.

For each recipe (the unpatched baseline first) :func:`measure_model` builds the architecture from
its config with random weights, optionally wraps it in PEFT LoRA/QLoRA, applies hf_actq, and runs
one forward, backward and AdamW step, measuring:

- activation memory: the bytes autograd holds for backward after the forward pass
  (:class:`SavedTensorMeter`, by storage, parameters excluded, packed buffers, scales, masks and
  tables all included), per op kind, and again by walking the autograd graph
  (:func:`graph_saved_bytes`) as an independent check;
- model state: parameters and buffers, gradients and optimizer state, from the tensors themselves;
- peak memory of the step (:class:`PeakMemory`: allocator events on CPU, CUDA's counters on GPU)
  plus the memory live when the step began.

The peak is measured per phase of the step (forward, the head's backward, the layers', the
embeddings', the optimizer step), and the report says in which phase it falls.

Models too large for this machine are measured with 1 and 2 layers and every figure is
extrapolated linearly to the full depth (layers are identical, so the per-layer difference is
exact for activations and model state), and the report says so. The peak is an estimate: each
phase's peak is extrapolated on its own and the largest taken, because the phase holding the
peak can change with depth (a large vocabulary's head backward at 1 and 2 layers, the optimizer
step at 26), where extrapolating the step's peak itself would follow the wrong phase's slope. The
largest batch that fits a GPU follows the few-bit paper's App. B:
``floor((gpu_memory - model_state) / activation_per_sample)``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections.abc import Callable
from dataclasses import replace

import torch

from hf_actq.config import ActQConfig
from hf_actq.memory.meter import SavedTensorMeter, _storage_key, graph_saved_bytes
from hf_actq.memory.peak import PeakMemory
from hf_actq.report.models import (
    build_model,
    decoder_layers,
    default_task,
    fits_on_device,
    is_vision_language,
    make_inputs,
    max_positions,
    text_config,
)
from hf_actq.report.recipes import STOCK_CHECKPOINTING, describe_recipe, parse_recipe
from hf_actq.report.results import Measurement, MemoryReport, RecipeResult

PEFT_MODES = ("none", "lora", "qlora")


TASKS = ("causal-lm", "classification", "seq2seq-lm")


_FIGURES = (
    "activation_bytes",
    "graph_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "peak_bytes",
)


def measure_model(
    config,
    recipes: list[str],
    *,
    name: str | None = None,
    batch_size: int = 8,
    seq_len: int = 128,
    dtype: torch.dtype = torch.float32,
    peft: str = "none",
    task: str | None = None,
    layers: str = "auto",
    gpu_memory_bytes: int = 80 * 2**30,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    calibration_examples: int = 2,
    calibration_slots: int | None = 4,
    calibration_seconds: float = math.inf,
    progress: Callable[[str, int], None] | None = None,
) -> MemoryReport:
    """Measures ``config``'s architecture under each recipe; see the module docstring.

    ``progress(what, total)`` is called before each of the ``total`` measured steps.

    ``layers``: "all" builds every layer, "scaled" measures 1 and 2 layers and extrapolates,
    "auto" picks "all" when four copies of the parameters (weights, gradients, two Adam moments)
    take under a quarter of the available RAM (or GPU memory).

    Adaptive recipes ("alam") calibrate their bit plan on ``calibration_examples`` examples of
    the step's batch, measuring at most ``calibration_slots`` tensors (None: all) within
    ``calibration_seconds``, before the step is measured; the plan is part of the result. A slot
    count gives the same plan on any machine; a time cap does not.
    """
    if peft not in PEFT_MODES:
        raise ValueError(f"peft must be one of {', '.join(PEFT_MODES)}, got {peft!r}")
    task = task or default_task(config)
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if layers not in ("auto", "all", "scaled"):
        raise ValueError(f"layers must be 'auto', 'all' or 'scaled', got {layers!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch size and sequence length must be >= 1, got {batch_size}, {seq_len}"
        )
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {limit} positions {config.model_type} supports"
        )
    parsed = [("baseline", None)]
    parsed += [item for item in map(parse_recipe, recipes) if item[1] is not None]
    device = torch.device(device)
    num_layers = text_config(config).num_hidden_layers
    if layers == "auto":
        layers = "all" if fits_on_device(config, task, dtype, device) else "scaled"
    if decoder_layers(config) not in (None, num_layers):
        layers = "all"  # scaling one depth for both stacks would misstate the decoder
    period = layer_period(config)
    if layers == "scaled" and (num_layers % period or num_layers <= 2 * period):
        layers = "all"  # no whole number of periods to extrapolate by
    measured_layers = [num_layers] if layers == "all" or num_layers <= 2 else [period, 2 * period]

    results = []
    total_steps = len(parsed) * len(measured_layers)
    setup = (batch_size, seq_len, dtype, peft, task, device, attn_implementation)
    budget = (calibration_examples, calibration_slots, calibration_seconds)
    for label, actq_config in parsed:
        runs = []
        plan_from = None
        # Deepest first: an adaptive plan is calibrated there once and the shallower model
        # takes it restricted to its own slots. Two plans of their own would spend the same
        # average differently, and extrapolating their difference to the full depth has no
        # plan behind it (LLaMA2-7B LoRA at micro-batch 1 came out above the even spread).
        for depth in reversed(measured_layers):
            if progress:
                progress(f"{label}, {depth} layer{'s' * (depth > 1)}", total_steps)
            step = _measure_step(config, actq_config, depth, *setup, budget, plan_from)
            runs.insert(0, step)
            plan_from = runs[0][2]
        measurement = runs[0][0]
        if len(runs) == 2:
            measurement = _extrapolate(runs[0][0], runs[1][0], num_layers // period)
        as_dict = actq_config.to_dict() if isinstance(actq_config, ActQConfig) else None
        _, patched, plan, kinds = runs[-1]
        if plan is not None:
            plan["info"]["scaled"] = len(runs) == 2
        results.append(
            RecipeResult(
                label, as_dict, measurement, patched, plan, kinds, describe_recipe(actq_config)
            )
        )
    return MemoryReport(
        model=name or config.model_type,
        model_type=config.model_type,
        num_layers=num_layers,
        measured_layers=measured_layers,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=str(dtype).removeprefix("torch."),
        peft=peft,
        task=task,
        device=str(device),
        gpu_memory_bytes=gpu_memory_bytes,
        results=results,
        note=(
            "A vision-language model, measured on text alone: its vision tower's weights are in "
            "the model state, its activations (images) are not measured."
            if is_vision_language(config)
            else ""
        ),
    )


# Layer kinds that differ in their modules, not only in their mask: a hybrid decoder's
# linear-attention (Qwen3.5, Qwen3-Next) or state-space layers beside its attention ones.
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def layer_period(config) -> int:
    """How many layers repeat: 1, or for a text config whose ``layer_types`` mix layers of other
    modules (Qwen3.5: three linear-attention layers, then an attention one; Gemma 4: five
    sliding layers, then a full one with wider heads) the shortest repeating run of them, which
    a scaled report measures once and twice."""
    text = text_config(config)
    kinds = getattr(text, "layer_types", None)
    if not isinstance(kinds, list) or not kinds:
        return 1
    # Sliding and full attention layers hold the same tensors, unless the config sets layers
    # apart (transformers' per-layer configs: Gemma 4's full layers have wider heads).
    if not getattr(text, "is_heterogeneous", False):
        kinds = ["attention" if kind in _ATTENTION_KINDS else kind for kind in kinds]
    return next(
        p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds))
    )


def _extrapolate(one: Measurement, two: Measurement, periods: int) -> Measurement:
    """The measurement at ``periods`` times the depth of ``one`` (``two``: at twice it)."""

    def scale(a, b):
        return a + (periods - 1) * (b - a)

    figures = {name: scale(getattr(one, name), getattr(two, name)) for name in _FIGURES}
    kinds = set(one.by_kind) | set(two.by_kind)
    by_kind = {k: scale(one.by_kind.get(k, 0), two.by_kind.get(k, 0)) for k in kinds}
    by_phase = {}
    if one.peak_by_phase and one.peak_by_phase.keys() == two.peak_by_phase.keys():
        # Each phase grows at its own rate; the step's peak is the largest at full depth. (Phases
        # marked at one depth only leave the step's peak extrapolated as it is.)
        by_phase = {p: scale(one.peak_by_phase[p], two.peak_by_phase[p]) for p in two.peak_by_phase}
        figures["peak_bytes"] = max(by_phase.values())
    return Measurement(**figures, by_kind=by_kind, peak_by_phase=by_phase)


def _measure_step(
    config,
    actq_config,
    num_layers,
    batch_size,
    seq_len,
    dtype,
    peft,
    task,
    device,
    attn,
    budget,
    plan_from=None,
) -> tuple[Measurement, int, dict | None, dict]:
    """One step's measurement, the number of patched modules, and for an adaptive recipe the
    plan it calibrated on the step's inputs (and the slots' kinds). ``plan_from``: a deeper
    model's plan (a dict), whose settings for this model's slots are used instead."""
    model = build_model(config, num_layers, dtype, peft, task, device, attn)
    model.train()
    inputs = make_inputs(model.config, task, batch_size, seq_len, device)
    patched, plan, kinds = 0, None, {}
    stock_checkpointing = actq_config == STOCK_CHECKPOINTING
    if stock_checkpointing:
        _enable_stock_checkpointing(model)
    elif actq_config is not None:
        from hf_actq.integrations.transformers import apply

        if actq_config.checkpoint_bits is not None:
            _cache_off(model)

        adaptive = actq_config.adaptive and actq_config.plan is None
        with _quiet(adaptive):  # the plan is calibrated right here
            handle = apply(model, actq_config)
        if adaptive and plan_from is not None:
            from hf_actq.adaptive.plan import BitPlan

            own = {slot: plan_from["slots"][slot] for slot in handle.slots}
            handle.revert()
            handle = apply(model, replace(actq_config, plan=BitPlan(own, plan_from["target_bits"])))
            adaptive = False
        patched, kinds = len(handle.patched), dict(handle.slots)
        if adaptive:
            examples, slots, seconds = budget
            examples = min(examples, actq_config.calibration_examples)  # ALAM's own: one
            caps = [n for n in (slots, actq_config.calibration_slots) if n is not None]
            slots = min(caps, default=None)  # the report's count and the recipe's own
            plan = handle.calibrate(inputs, examples=examples, slots=slots, seconds=seconds)
            plan = plan.to_dict()
            plan["info"]["examples"] = min(examples, batch_size)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    _create_optimizer_state(optimizer, trainable)
    model_bytes = _distinct_bytes(_model_tensors(model))
    optimizer_bytes = _distinct_bytes(_optimizer_tensors(optimizer))

    with PeakMemory(device, phase="forward") as peak, _layer_phase_marks(model, peak):
        with (
            SavedTensorMeter(exclude=params, model=model) as meter,
            _checkpointed_inputs_counted(model, meter, stock_checkpointing),
        ):
            loss = model(**inputs).loss
        # Walking a checkpointed graph's saved tensors would recompute the layers: the walk
        # checks hf_actq's own accounting, and stock checkpointing has none of it.
        graph_bytes = (
            meter.nbytes if stock_checkpointing else graph_saved_bytes(loss, exclude=params)
        )
        peak.mark("head backward")
        loss.backward()
        grad_bytes = _distinct_bytes(p.grad for p in trainable if p.grad is not None)
        peak.mark("optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state_bytes = model_bytes + optimizer_bytes
    measurement = Measurement(
        activation_bytes=meter.nbytes,
        graph_bytes=graph_bytes,
        param_bytes=model_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        peak_bytes=state_bytes + peak.peak_bytes,
        by_kind=meter.by_kind(),
        peak_by_phase={phase: state_bytes + b for phase, b in peak.phase_peaks.items()},
    )
    del model, optimizer, loss, meter
    # Patched forwards are bound methods on their module (a reference cycle): collect now, or
    # the next recipe's model is built while this one is still in memory.
    gc.collect()
    return measurement, patched, plan, kinds


def _enable_stock_checkpointing(model) -> None:
    """transformers' own non-reentrant gradient checkpointing on ``model`` (the base model of a
    PEFT model); ValueError where the model has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(base).__name__} does not support gradient checkpointing: leave out the "
            f"{STOCK_CHECKPOINTING} recipe"
        )
    _cache_off(base)
    kwargs = {"use_reentrant": False}
    turn_on = getattr(base, "activation_checkpointing_enable", None)
    if turn_on is not None:
        turn_on(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _cache_off(model) -> None:
    """``use_cache=False`` on a model about to train with checkpointed layers: what transformers
    would switch off itself, with a warning in the report's output."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "use_cache", False):
        base.config.use_cache = False


@contextlib.contextmanager
def _checkpointed_inputs_counted(model, meter: SavedTensorMeter, active: bool):
    """Counts, under ``active`` (stock checkpointing), the inputs each checkpointed layer keeps
    to recompute itself: autograd's saved-tensor hooks never see them (the checkpoint's
    closure holds them), yet they stay until the layer's backward."""
    if not active:
        yield
        return
    from hf_actq.integrations.checkpointing import checkpointed_layers

    def keep_inputs(module, args, kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                meter.keep(value)

    handles = [
        layer.register_forward_pre_hook(keep_inputs, with_kwargs=True)
        for layer in checkpointed_layers(model).values()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _layer_phase_marks(model, peak: PeakMemory):
    """Marks the backward's phases at the layer stack's ends: "layer backward" when the last
    layer's output gradient arrives, "embedding backward" when the first layer's input gradient
    does. Hooks are set on the first forward only; a layer whose output or input needs no
    gradient there (frozen embeddings, layers checkpointed inside an autograd.Function) leaves
    its mark out, and its phase runs into the one before. Encoder-decoders are left unmarked: a
    phase would span both stacks. Of several stacks (a vision-language model's towers) the
    language model's is marked: the last stack in module order."""
    from hf_actq.integrations.checkpointing import checkpointed_layers

    stacks: dict[str, list] = {}
    for path, layer in checkpointed_layers(model).items():
        stacks.setdefault(path.rpartition(".")[0], []).append(layer)
    if not stacks or getattr(model.config, "is_encoder_decoder", False):
        yield
        return
    layers = list(stacks.values())[-1]

    def mark_on_gradient(tensor, phase):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: peak.mark(phase))

    def on_last_output(module, args, output):
        handles.pop("last").remove()
        mark_on_gradient(
            output if isinstance(output, torch.Tensor) else output[0], "layer backward"
        )

    def on_first_input(module, args, kwargs):
        handles.pop("first").remove()
        hidden = args[0] if args else kwargs.get("hidden_states")
        mark_on_gradient(hidden, "embedding backward")

    handles = {
        "last": layers[-1].register_forward_hook(on_last_output),
        "first": layers[0].register_forward_pre_hook(on_first_input, with_kwargs=True),
    }
    try:
        yield
    finally:
        for handle in handles.values():
            handle.remove()


@contextlib.contextmanager
def _quiet(active: bool):
    """Hides hf_actq's warnings (the calibrate-me reminder) while ``active``."""
    logger = logging.getLogger("hf_actq")
    level = logger.level
    if active:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _create_optimizer_state(optimizer, trainable) -> None:
    """AdamW allocates its moments on the first step; take that step with lr 0 and zero
    gradients (parameters unchanged) so the measured step runs with the state in memory, as
    every step after the first does."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _model_tensors(model):
    yield from model.parameters()
    yield from model.buffers()
    for p in model.parameters():
        # bitsandbytes keeps its 4-bit absmax/code tensors on the parameter's quant_state.
        state = getattr(p, "quant_state", None)
        while state is not None:
            yield from (v for v in vars(state).values() if isinstance(v, torch.Tensor))
            state = getattr(state, "state2", None)


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _distinct_bytes(tensors) -> int:
    storages = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
