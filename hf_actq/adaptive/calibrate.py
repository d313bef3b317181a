"""The adaptive pass, as ALAM's official code runs it: measure each saved tensor's sensitivity,
allocate code bits to a target average, and return a :class:`~hf_actq.adaptive.plan.BitPlan`.

Sensitivity is ALAM's GradNormVar (Algorithm 2 of the paper; ``alam/autoprec.py`` in its code):
for each tensor (slots that share one packed tensor, q, k and v's input, are one), three
backwards on the calibration examples with that tensor at AQ 0.5 bit under two rounding seeds
and at 8 bits, every other at its current precision (uniform 4 bits before the first plan); the
sensitivity compares the three vectors of per-parameter gradient norms
(:func:`hf_actq.adaptive.alam.sensitivity`). The allocation (:func:`hf_actq.adaptive.alam.allocate`)
gives each tensor a rung of the ladder exact/8/4/2/AQ 0.5 so that the code bits, averaged over
every saved tensor and with scales not counted (ALAM's accounting), meet the target; the plan's
info gives every byte we count beside it. Few-bit codes that cannot take a codec (a gated MLP's
activation, ReLU's exact bit) keep their bits and count them.

Our own allocator (measured candidate errors, a sketched gradient variance) was retired on
2026-11-27: per parameter group it erred by bias where ALAM's plan errs by noise, and it trained
worse on GLUE (docs/reference.md, "ALAM as published").

The pass leaves the training state as it found it: rounding seeds come from the slot ids (no
draw from torch's RNG), dropout masks and the RNG state are restored (``fork_rng``), existing
gradients are put back, the optimizer is never touched. Its cost is bounded by
``calibration_examples`` (a sub-batch), ``calibration_slots`` (a count: the plan does not depend
on the machine) and ``calibration_seconds`` (a time cap: it does). Tensors are measured one kind
after another in turn, each kind's spread over depth, so a pass cut short has sampled every kind
and layer it could; tensors left unmeasured take the median sensitivity of their kind. Under
torch.distributed every rank runs the same passes and the sensitivities are averaged, so all
ranks get the same plan.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time
import zlib
from dataclasses import dataclass

import torch

from hf_actq.adaptive import alam
from hf_actq.adaptive.plan import BitPlan
from hf_actq.codecs.packed import ExactCodec
from hf_actq.ops.slots import SlotObserver, observe, slot_seeds

logger = logging.getLogger("hf_actq")


@dataclass
class SlotInfo:
    """One slot as a forward filled it: shape, the bytes it kept and, for slots that reuse
    another slot's packed tensor, that slot."""

    slot: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: str
    nbytes: int
    shared_with: str | None = None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class _Recorder(SlotObserver):
    """Each slot a forward fills, once: its shape, codec and bytes."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.infos: dict[str, SlotInfo] = {}

    def _new(self, slot) -> str | None:
        kind = self.handle.slots.get(slot)
        return None if kind is None or slot in self.infos else kind

    def on_pack(self, slot, x, codec, nbytes, shared_with):
        kind = self._new(slot)
        if kind is not None:
            self.infos[slot] = SlotInfo(
                slot, kind, tuple(x.shape), x.dtype, repr(codec), nbytes, shared_with
            )

    def on_fewbit(self, slot, x, activation):
        kind = self._new(slot)
        if kind is not None:
            nbytes = (x.numel() * activation.bits + 7) // 8 + 4
            self.infos[slot] = SlotInfo(
                slot, kind, tuple(x.shape), x.dtype, activation.describe(), nbytes
            )


def _seeds(base: int, changed: set[str] = frozenset(), other: int = 0):
    def seed_for(slot: str) -> int:
        return zlib.crc32(f"{other if slot in changed else base}:{slot}".encode()) & 0x7FFFFFFF

    return seed_for


def _sub_batch(batch, examples: int):
    if isinstance(batch, torch.Tensor):
        return batch[:examples]
    return {
        k: v[:examples] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
        for k, v in dict(batch).items()
    }


def _default_loss(model, batch):
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise ValueError(
            "calibration needs the model's loss: pass a batch with labels, or loss_fn="
        )
    return loss


def _check_measurable(loss) -> None:
    """ValueError unless ``loss`` is finite: a batch with no supervised token (every label
    ignored) has a NaN loss and zero gradients, from which no sensitivity can be measured."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"calibration needs a scalar loss, got {loss!r}")
    if not torch.isfinite(loss.detach()).item():
        raise ValueError(
            f"calibration: the loss on this batch is {loss.item()}, so no slot's effect on the "
            "gradient can be measured (a batch whose labels are all ignored, -100, has a NaN "
            "loss); calibrate on a batch with supervised tokens and finite inputs"
        )


def _norm(grad: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(grad.float())
    if hasattr(norm, "full_tensor"):  # FSDP2: a sharded gradient's norm is a collective
        norm = norm.full_tensor()
    return norm.reshape(1)


def _fingerprint(grads) -> torch.Tensor:
    """What the passes compare of the gradient, as ALAM does: each parameter tensor's norm."""
    return torch.cat(
        [
            torch.zeros(1, dtype=torch.float64) if g is None else _norm(g).double().cpu()
            for g in grads
        ]
    )


ZERO3_UNSUPPORTED = (
    "hf_actq: ALAM's calibration cannot run under DeepSpeed ZeRO-3 with sharded parameters "
    "(ZeRO-3 partitions every gradient its backwards make, and it runs dozens); calibrate a "
    "plan without ZeRO-3 (handle.calibrate(batch) in one process, then handle.plan.save(path)) "
    "and pass ActQConfig(plan=path), or train with adaptive=False"
)


def _gradient_taker(params):
    """How a measuring pass gets the gradients: ``backward`` into ``.grad`` (as FSDP2 needs,
    whose reduction runs in its post-backward hooks), or ``torch.autograd.grad`` under DeepSpeed
    ZeRO-1/2, whose hooks on each parameter's accumulation would reduce the pass's gradients
    into the optimizer's. ZeRO-3 is refused (``ZERO3_UNSUPPORTED``)."""
    if any(hasattr(p, "ds_id") for p in params):
        raise NotImplementedError(ZERO3_UNSUPPORTED)
    if any(hasattr(p, "_hp_mapping") for p in params):

        def without_accumulating(loss):
            return torch.autograd.grad(loss, params, allow_unused=True)

        return without_accumulating

    def into_grad(loss):
        loss.backward()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    return into_grad


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _collective_device() -> torch.device:
    """Where the process group reduces: NCCL (what ``accelerate launch`` starts on GPUs) takes
    CUDA tensors only; gloo, and a ``cpu:gloo,cuda:nccl`` group, take CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _average_across_ranks(values: list[float]) -> list[float]:
    """The mean over ranks (every rank passes its values in the same order)."""
    if not _distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(tensor)
    return (tensor / torch.distributed.get_world_size()).tolist()


def _all_ranks_agree_to_stop(stop: bool) -> bool:
    if not _distributed():
        return stop
    flag = torch.tensor([float(stop)], device=_collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def calibrate(
    handle,
    batch,
    *,
    loss_fn=None,
    examples: int | None = None,
    seconds: float | None = None,
    slots: int | None = None,
    target_bits: float | None = None,
    budget_bytes: int | None = None,
) -> BitPlan:
    """Measure the slots of ``handle``'s model on ``batch`` and allocate ``target_bits`` (default
    ``config.bits``) on average, or ``budget_bytes`` in all, over them. Returns the plan; the
    model keeps its current settings (``handle.calibrate`` installs the plan)."""
    config = handle.config
    model = handle.model
    loss_fn = loss_fn or _default_loss
    examples = examples or config.calibration_examples
    seconds = seconds or config.calibration_seconds
    slots = slots or config.calibration_slots
    target_bits = config.bits if target_bits is None else target_bits
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("calibration needs trainable parameters (none require grad)")
    device = params[0].device
    batch = _sub_batch(batch, examples)
    if isinstance(batch, dict):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    take_gradients = _gradient_taker(params)
    saved_grads = [p.grad for p in params]
    start = time.perf_counter()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), training_mode(model):
        rng_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))

        def run(seed_for) -> torch.Tensor:
            torch.manual_seed(rng_seed)  # the same dropout masks in every pass
            with slot_seeds(seed_for):
                loss = loss_fn(model, batch)
                _check_measurable(loss)
                fingerprint = _fingerprint(take_gradients(loss))
            if not torch.isfinite(fingerprint).all():
                raise ValueError(
                    "calibration: this batch gives non-finite gradients; calibrate on another "
                    "batch (or find the overflow: a loss scale, a half-precision model)"
                )
            return fingerprint

        try:
            for p in params:
                p.grad = None
            recorder = _Recorder(handle)
            with observe(recorder):
                h0 = run(_seeds(1))
            if not h0.any():
                raise ValueError(
                    "calibration: this batch gives a zero gradient to every trainable "
                    "parameter, so no slot's effect can be measured; calibrate on a batch with "
                    "supervised tokens"
                )
            items = _items(handle, recorder)
            sensitivity, measured = _measure(handle, items, run, start, seconds, slots)
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
    return _plan(handle, recorder, items, sensitivity, measured, target_bits, budget_bytes, start)


@contextlib.contextmanager
def training_mode(model):
    """``model`` in training mode (hf_actq compresses nothing in eval, so there would be
    nothing to measure), each module's own mode put back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _is_fewbit(handle, slot: str) -> bool:
    """An activation's slot planned as a few-bit code: it holds one (not its input under a
    codec), or ``allocate_activations`` is off, which counts every activation as few-bit."""
    state, name = handle._states[slot]
    kept = state.codecs.get("act") is None or not handle.config.allocate_activations
    return name == "act" and kept


def _fill_unmeasured(handle, items, sensitivity: dict) -> None:
    """Items left unmeasured within the caps take the median of their kind's."""
    for slot in items:
        if slot not in sensitivity:
            kind = handle.slots[slot]
            same = [v for s, v in sensitivity.items() if handle.slots[s] == kind]
            sensitivity[slot] = statistics.median(same or list(sensitivity.values()) or [1.0])


def list_slots(handle, batch) -> dict[str, SlotInfo]:
    """Every slot one forward on ``batch`` fills, with its shape, codec and bytes (the RNG is
    left as it was; nothing is kept)."""
    recorder = _Recorder(handle)
    with (
        torch.random.fork_rng(),
        observe(recorder),
        slot_seeds(_seeds(1)),
        torch.enable_grad(),
        training_mode(handle.model),
    ):
        out = handle.model(**batch) if isinstance(batch, dict) else handle.model(batch)
        del out
    return recorder.infos


def _items(handle, recorder) -> dict[str, list[str]]:
    """The tensors ALAM allocates, each with the slots that share it: every codec slot that
    packed its own tensor, and standalone activations (their input, under a codec) unless
    ``allocate_activations`` is off. Few-bit codes that cannot be a codec (a gated MLP's
    activation, ReLU's exact bit) stay as they are."""
    allocate_activations = handle.config.allocate_activations
    items: dict[str, list[str]] = {}
    for slot, info in recorder.infos.items():
        state, name = handle._states[slot]
        if name == "act" and not (state.act_codec and allocate_activations):
            continue
        if info.shared_with is None or info.shared_with not in recorder.infos:
            items[slot] = [slot]
    for slot, info in recorder.infos.items():
        if info.shared_with in items and slot not in items:
            items[info.shared_with].append(slot)
    return items


@contextlib.contextmanager
def _overridden(handle, codecs: dict):
    """Slots given other codecs for a while (an activation's "act" slot given a codec keeps
    its input under it); every change undone on exit."""
    before = []
    try:
        for slot, codec in codecs.items():
            state, name = handle._states[slot]
            before.append((state, name, state.codecs.get(name, _ABSENT)))
            state.codecs[name] = codec
        yield
    finally:
        for state, name, codec in reversed(before):
            if codec is _ABSENT:
                state.codecs.pop(name, None)
            else:
                state.codecs[name] = codec


_ABSENT = object()


def measuring_order(handle, items) -> list[str]:
    """The order in which the pass measures ``items`` (leaders): one of each kind in turn,
    each kind's in :func:`spread_order` over depth. A pass cut short then has a measured median
    for as many kinds as it could, taken across the depth rather than from the first layer."""
    by_kind: dict[str, list[str]] = {}
    for leader in items:
        by_kind.setdefault(handle.slots[leader], []).append(leader)
    spread = [[leaders[i] for i in spread_order(len(leaders))] for leaders in by_kind.values()]
    rounds = itertools.zip_longest(*spread)
    return [leader for one_round in rounds for leader in one_round if leader is not None]


def spread_order(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix spreads over the range: the ends, then the middle
    of each gap, widest gaps first (5 -> 0, 4, 2, 1, 3)."""
    order = [0, n - 1][: min(n, 2)]
    gaps = [(0, n - 1)]
    while gaps:
        middles = [((lo + hi) // 2, lo, hi) for lo, hi in gaps if hi - lo > 1]
        order += [mid for mid, _, _ in middles]
        gaps = [gap for mid, lo, hi in middles for gap in ((lo, mid), (mid, hi))]
    return order


def _measure(handle, items, run, start, seconds, slots):
    """ALAM's GradNormVar, as its code runs it: each tensor at AQ 0.5 bit with two rounding
    seeds and at 8 bits, every other at its current precision (uniform 4 bits before the first
    plan); ``alam.sensitivity`` of the three per-parameter gradient-norm vectors. At most
    ``slots`` items (None: all) are measured, in :func:`measuring_order`, within ``seconds``."""
    config = handle.config

    def codec(precision):
        return config.codec_for_setting(alam.SETTINGS[precision])

    members = [slot for group in items.values() for slot in group]
    context = {} if handle.plan is not None else dict.fromkeys(members, codec(4))
    sensitivity: dict[str, float] = {}
    measured: list[str] = []
    with _overridden(handle, context):
        for leader in measuring_order(handle, items):
            enough = slots is not None and len(measured) >= slots
            if _all_ranks_agree_to_stop(enough or time.perf_counter() - start > seconds):
                if not enough:  # every rank has measured as many: the clock stopped it
                    _warn_time_cap(seconds, len(measured), len(items))
                break
            group = items[leader]
            with _overridden(handle, dict.fromkeys(group, codec("aq"))):
                g0 = run(_seeds(1))
                g1 = run(_seeds(1, set(group), 2))
            with _overridden(handle, dict.fromkeys(group, codec(8))):
                g2 = run(_seeds(1))
            sensitivity[leader] = alam.sensitivity(g0, g1, g2)
            measured.append(leader)
    values = _average_across_ranks([sensitivity[s] for s in measured])
    sensitivity = dict(zip(measured, values))
    _fill_unmeasured(handle, items, sensitivity)
    return {leader: sensitivity[leader] for leader in items}, measured


def _warn_time_cap(seconds: float, measured: int, items: int) -> None:
    # Silent, a cut pass would make two runs of one config train differently on two machines.
    logger.warning(
        "hf_actq: calibration reached its time cap (calibration_seconds=%s) after measuring %d "
        "of %d tensors; the other %d take their kind's median sensitivity, so this plan "
        "depends on the machine's speed and load. Set calibration_slots for a plan that does "
        "not, or calibration_seconds=math.inf to measure every tensor.",
        seconds,
        measured,
        items,
        items - measured,
    )


def _plan(handle, recorder, items, sensitivity, measured, target_bits, budget_bytes, start):
    """ALAM's allocation (``alam.allocate``) over ``items``, to ``target_bits`` code bits per
    element on average over every slot's tensor (few-bit codes count their bits), or to
    ``budget_bytes`` of code bytes; the plan's info says both ALAM's figure and our bytes."""
    config = handle.config
    elements = {leader: recorder.infos[leader].numel for leader in items}
    in_items = {slot for group in items.values() for slot in group}
    fewbit = [s for s, i in recorder.infos.items() if s not in in_items and i.shared_with is None]
    fewbit_bits = sum(
        recorder.infos[s].numel * handle._states[s][0].activation.bits for s in fewbit
    )
    total_elements = sum(elements.values()) + sum(recorder.infos[s].numel for s in fewbit)
    budget_bits = target_bits * total_elements if budget_bytes is None else 8 * budget_bytes
    item_elements = max(1, sum(elements.values()))
    precisions, bits = alam.allocate(
        sensitivity, elements, max(1e-9, (budget_bits - fewbit_bits) / item_elements)
    )
    settings, counted = {}, 0
    for leader, group in items.items():
        setting = alam.SETTINGS[precisions[leader]]
        for slot in group:
            settings[slot] = dict(setting)
        info = recorder.infos[leader]
        codec = config.codec_for_setting(setting)
        exact = isinstance(codec, ExactCodec)
        counted += info.numel * info.dtype.itemsize if exact else codec.nbytes(info.shape)
    even_setting = {"codec": config.codec, "bits": config.bits, "group_size": config.group_size}
    for slot in handle.slots:
        if slot in settings:
            continue
        if _is_fewbit(handle, slot):
            settings[slot] = {"bits": handle._states[slot][0].activation.bits}
            counted += recorder.infos[slot].nbytes if slot in recorder.infos else 0
        else:  # never filled on this batch (a frozen layer's input): the even setting
            settings[slot] = dict(even_setting)
    code_bits = bits + fewbit_bits
    info = {
        "accounting": "alam: code bits over the slots' tensors, no scales",
        "budget_bytes": int(budget_bits // 8),
        "bytes": int(code_bits // 8),
        "counted_bytes": counted,
        "even_bytes": sum(i.nbytes for i in recorder.infos.values() if i.shared_with is None),
        "elements": total_elements,
        "alam_bits": code_bits / max(1, total_elements),
        "budget_met": code_bits <= budget_bits + 1e-6,
        "precisions": {s: str(precisions[s]) for s in sorted(precisions)},
        "sensitivity": {s: sensitivity[s] for s in sorted(sensitivity)},
        "measured": len(measured),
        "estimated": len(sensitivity) - len(measured),
        "shared": {s: i.shared_with for s, i in recorder.infos.items() if i.shared_with},
        "seconds": round(time.perf_counter() - start, 3),
    }
    if not info["budget_met"]:
        logger.warning(
            "hf_actq: %d code bits cannot hold these slots even at AQ 0.5 bit; each takes AQ "
            "(%d bits)",
            budget_bits,
            code_bits,
        )
    return BitPlan(settings, target_bits, info)
