"""The adaptive pass: measure each slot's sensitivity, allocate precision to a byte budget, and
return a :class:`~hf_actq.adaptive.plan.BitPlan`.

Sensitivity follows ALAM's Algorithm 2, slot by slot: one backward with every slot's rounding
seeded from ``r1`` gives a fingerprint ``h0`` of the trainable parameters' gradient; a backward in
which only slot ``l`` takes seed ``r2`` gives ``h1``; ``0.5 * ||h0 - h1||^2`` is the variance that
slot's rounding adds. ALAM's fingerprint (``sensitivity="gradnormvar"``) is the L2 norm of each
parameter tensor's gradient. The default (``"gradvar"``) is the gradient itself, count-sketched to
at most ``SKETCH_SIZE`` numbers per tensor (random signs, so ``||S(g0 - g1)||^2`` is an unbiased
estimate of ``||g0 - g1||^2``): on a pretrained MiniLM the norms see 10^2 to 10^5 times less of a
linear layer's input noise than the gradient carries, because that noise mostly turns the
gradient without changing its length, and a plan built on them starves those inputs
(docs/reference.md, "Adaptive precision"). Slots that share one packed tensor (q, k and v's input)
are one item. ALAM scales the variance by ``(2^b - 1)^2`` to get a sensitivity ``c_l`` and
predicts ``c_l (2^b - 1)^-2`` at ``b`` bits; here the sensitivity is the gradient's variance per
unit of the same seed-to-seed variance measured on the slot's own tensor, and a candidate's
prediction is the sensitivity times its measured relative error on that tensor (from the first
pass), so average quantization and stochastic rounding share one scale. Below 1 bit linear-layer
inputs get rotated sampling instead of average quantization (``codec_candidates``): averaging
them biases the weight gradient in a way no seed changes, which this pass cannot see. With
``chain_bits`` the other codec slots (norm inputs, attention and gated-MLP operands, whose noise
compounds through the layers below: another thing a slot-at-a-time pass cannot see) get only
uniform rounding at that precision or more. Few-bit
slots are deterministic: their effect is the squared gradient change when the slot's table
switches between two bit widths, scaled by the tables' measured derivative errors on the slot's
own inputs.

The pass leaves the training state as it found it: rounding seeds come from the slot ids (no
draw from torch's RNG), dropout masks and the RNG state are restored (``fork_rng``), existing
gradients are put back, the optimizer is never touched. Its cost is bounded by
``calibration_examples`` (a sub-batch) and ``calibration_seconds`` (slots left unmeasured take
the median sensitivity of their kind). Under torch.distributed every rank runs the same passes
and the sensitivities are averaged, so all ranks get the same plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import zlib
from dataclasses import dataclass

import torch

from hf_actq.adaptive import alam
from hf_actq.adaptive.allocate import Candidate, Item, allocate
from hf_actq.adaptive.plan import BitPlan
from hf_actq.kernels import fewbit_backward, fewbit_forward
from hf_actq.ops.fewbit_activation import ActivationTable
from hf_actq.ops.slots import SlotObserver, observe, slot_seeds

logger = logging.getLogger("hf_actq")

# Candidate settings of codec slots (average bits). Below 1 bit, ALAM's average quantization,
# except for linear-layer inputs: averaging them projects the weight gradient onto a subspace (a
# bias no seed changes, invisible to the seed-to-seed variance measured here), so they get the
# unbiased rotated sampling at the same bytes (hf_actq/codecs/rotated.py).
UNIFORM_CANDIDATES = tuple({"codec": "uniform", "bits": b} for b in (8, 4, 2, 1))
SUB_BIT = ((1, 2), (0.5, 4), (0.25, 8))
CODEC_CANDIDATES = UNIFORM_CANDIDATES + tuple(
    {"codec": "aq", "bits": b, "group_size": g} for b, g in SUB_BIT
)
LINEAR_INPUT_CANDIDATES = UNIFORM_CANDIDATES + tuple(
    {"codec": "rotated", "bits": b, "group_size": g} for b, g in SUB_BIT
)
FEWBIT_CANDIDATES = (1, 2, 3, 4)
# Elements of a slot's tensor the candidates' errors are measured on.
_SAMPLE = 1 << 16
# Numbers kept of each parameter tensor's gradient under sensitivity="gradvar" (smaller tensors
# are kept whole). The estimate's relative error is about sqrt(2 / buckets the change fills).
SKETCH_SIZE = 4096


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
    def __init__(self, handle, measure: bool) -> None:
        self.handle, self.measure = handle, measure
        self.infos: dict[str, SlotInfo] = {}
        # slot -> (errors of the candidates, seed-to-seed variance of the current codec; for
        # few-bit slots the current table's error)
        self.errors: dict[str, tuple[list[float], float]] = {}

    def _new(self, slot) -> str | None:
        kind = self.handle.slots.get(slot)
        return None if kind is None or slot in self.infos else kind

    def on_pack(self, slot, x, codec, nbytes, shared_with):
        kind = self._new(slot)
        if kind is None:
            return
        self.infos[slot] = SlotInfo(
            slot, kind, tuple(x.shape), x.dtype, repr(codec), nbytes, shared_with
        )
        if self.measure and shared_with is None:
            config = self.handle.config
            codecs = [config.codec_for_setting(s) for s in codec_candidates(self.handle, slot)]
            self.errors[slot] = (_codec_errors(x, codecs), _seed_variance(x, codec))

    def on_fewbit(self, slot, x, activation):
        kind = self._new(slot)
        if kind is None:
            return
        nbytes = (x.numel() * activation.bits + 7) // 8 + 4
        self.infos[slot] = SlotInfo(
            slot, kind, tuple(x.shape), x.dtype, activation.describe(), nbytes
        )
        if self.measure:
            errors = _fewbit_errors(x, activation)
            self.errors[slot] = (errors, errors[FEWBIT_CANDIDATES.index(activation.bits)])


def _sample(x: torch.Tensor) -> torch.Tensor:
    rows = x.detach().reshape(-1, x.shape[-1])
    return rows[: max(1, _SAMPLE // max(1, x.shape[-1]))].contiguous()


def codec_candidates(handle, slot: str) -> tuple[dict, ...]:
    """The settings the allocator may give codec slot ``slot``. With ``config.chain_bits`` the
    slots on the backward's chain (everything but linear-layer inputs) get only uniform
    stochastic rounding at that many bits or more: below it, averaging biases their gradients
    and rounding noise compounds through the layers below (docs/reference.md, "Per parameter
    group")."""
    linear_input = handle.slots.get(slot) in ("linear", "mlp") and slot.endswith(":input")
    if linear_input:
        return LINEAR_INPUT_CANDIDATES
    floor = handle.config.chain_bits
    if floor is None:
        return CODEC_CANDIDATES
    return tuple(c for c in UNIFORM_CANDIDATES if c["bits"] >= floor)


def _seed_variance(x, codec) -> float:
    """Half the relative squared change of ``codec``'s output between two rounding seeds: the
    part of its error the sensitivity pass sees change (what a biased codec gets wrong for
    every seed alike is not in it)."""
    sample = _sample(x)
    energy = sample.float().pow(2).sum().clamp_min(1e-30)
    first, second = (codec.pack(sample, seed).unpack().float() for seed in (1, 2))
    return float(0.5 * (first - second).pow(2).sum() / energy)


def _codec_errors(x, codecs) -> list[float]:
    """Relative squared error ``||x_hat - x||^2 / ||x||^2`` of each codec on a sample of x."""
    sample = _sample(x)
    reference = sample.float()
    energy = reference.pow(2).sum().clamp_min(1e-30)
    return [
        float((codec.pack(sample, 0).unpack().float() - reference).pow(2).sum() / energy)
        for codec in codecs
    ]


def _fewbit_errors(x, activation) -> list[float]:
    """Relative squared error of each candidate table's derivative on a sample of x."""
    sample = x.detach().reshape(-1)[:_SAMPLE]
    with torch.enable_grad():
        leaf = sample.float().requires_grad_()
        (exact,) = torch.autograd.grad(activation.plain(leaf).sum(), leaf)
    energy = exact.pow(2).sum().clamp_min(1e-30)
    errors = []
    for bits in FEWBIT_CANDIDATES:
        table = ActivationTable(activation.spec.name, bits, activation.params)
        borders, levels = table.tensors(sample.device)
        _, codes, flag = fewbit_forward(
            sample, table.spec.name, borders, table.bits, table.param_values, output=False
        )
        approx = fewbit_backward(torch.ones_like(exact), codes, levels, flag, table.bits)
        errors.append(float((approx.float() - exact).pow(2).sum() / energy))
    return errors


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


def _sketch(grad: torch.Tensor, index: int) -> torch.Tensor:
    """A count sketch of ``grad``: its elements in ``SKETCH_SIZE`` contiguous buckets, each
    element signed by a fixed random sign (seeded by the tensor's index, so every pass signs
    alike). Under FSDP2 the local shard is sketched: the squared distances then add up over ranks
    to a constant multiple of the whole, the same for every slot."""
    if hasattr(grad, "to_local"):
        grad = grad.to_local()
    flat = grad.detach().reshape(-1).float()
    if flat.numel() <= SKETCH_SIZE:
        return flat
    generator = torch.Generator(device=flat.device).manual_seed(index)
    signs = torch.randint(0, 2, flat.shape, generator=generator, device=flat.device)
    signed = flat * (signs * 2 - 1)
    padded = torch.nn.functional.pad(signed, (0, (-flat.numel()) % SKETCH_SIZE))
    return padded.view(SKETCH_SIZE, -1).sum(1)


def _fingerprint(params, sensitivity: str) -> torch.Tensor:
    """What the passes compare of the gradient: per-tensor norms or sketches, as one vector."""
    parts = []
    for index, p in enumerate(params):
        if p.grad is None:
            size = 1 if sensitivity == "gradnormvar" else min(p.numel(), SKETCH_SIZE)
            parts.append(torch.zeros(size, dtype=torch.float64))
        elif sensitivity == "gradnormvar":
            parts.append(_norm(p.grad).double().cpu())
        else:
            parts.append(_sketch(p.grad, index).double().cpu())
    return torch.cat(parts)


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _average_across_ranks(values: list[float]) -> list[float]:
    """The mean over ranks (every rank passes its values in the same order)."""
    if not _distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor)
    return (tensor / torch.distributed.get_world_size()).tolist()


def _all_ranks_agree_to_stop(stop: bool) -> bool:
    if not _distributed():
        return stop
    flag = torch.tensor([float(stop)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def calibrate(
    handle,
    batch,
    *,
    loss_fn=None,
    examples: int | None = None,
    seconds: float | None = None,
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
    target_bits = config.bits if target_bits is None else target_bits
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("calibration needs trainable parameters (none require grad)")
    device = params[0].device
    batch = _sub_batch(batch, examples)
    if isinstance(batch, dict):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    saved_grads = [p.grad for p in params]
    start = time.perf_counter()
    official = config.sensitivity == "alam"
    fingerprint_kind = "gradnormvar" if official else config.sensitivity
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        rng_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))

        def run(seed_for) -> torch.Tensor:
            torch.manual_seed(rng_seed)  # the same dropout masks in every pass
            with slot_seeds(seed_for):
                loss = loss_fn(model, batch)
                _check_measurable(loss)
                loss.backward()
            fingerprint = _fingerprint(params, fingerprint_kind)
            for p in params:
                p.grad = None
            if not torch.isfinite(fingerprint).all():
                raise ValueError(
                    "calibration: this batch gives non-finite gradients; calibrate on another "
                    "batch (or find the overflow: a loss scale, a half-precision model)"
                )
            return fingerprint

        try:
            for p in params:
                p.grad = None
            recorder = _Recorder(handle, measure=not official)
            with observe(recorder):
                h0 = run(_seeds(1))
            if not h0.any():
                raise ValueError(
                    "calibration: this batch gives a zero gradient to every trainable "
                    "parameter, so no slot's effect can be measured; calibrate on a batch with "
                    "supervised tokens"
                )
            if official:
                items = _alam_items(handle, recorder)
                sensitivity, measured = _measure_alam(handle, items, run, start, seconds)
            else:
                sensitivity, measured = _measure(handle, recorder, run, h0, start, seconds)
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
    if official:
        return _alam_plan(
            handle, recorder, items, sensitivity, measured, target_bits, budget_bytes, start
        )
    return _plan(handle, recorder, sensitivity, measured, target_bits, budget_bytes, start)


def _items(recorder) -> list[str]:
    """Slots measured and allocated on their own: codec slots that packed their own tensor (the
    slots that reused it follow them) and few-bit slots."""
    return sorted(recorder.errors)


def _is_fewbit(handle, slot: str) -> bool:
    """An activation's slot holding a few-bit code (not its input under a codec)."""
    state, name = handle._states[slot]
    return name == "act" and state.codecs.get("act") is None


def _measure(handle, recorder, run, h0, start, seconds):
    items = _items(recorder)
    members = {slot: [slot] for slot in items}
    for slot, info in recorder.infos.items():
        if info.shared_with in members and slot not in members:
            members[info.shared_with].append(slot)
    sensitivity: dict[str, float] = {}
    measured: list[str] = []
    for slot in items:
        if _all_ranks_agree_to_stop(time.perf_counter() - start > seconds):
            break
        errors, current = recorder.errors[slot]
        if _is_fewbit(handle, slot):
            state, _ = handle._states[slot]
            act = state.activation
            other = 4 if act.bits < 4 else 1
            if act.exact or errors[other - 1] == current:
                sensitivity[slot] = 0.0
                measured.append(slot)
                continue
            state.activation = ActivationTable(act.spec.name, other, act.params)
            try:
                h1 = run(_seeds(1))
            finally:
                state.activation = act
            change = float((h0 - h1).pow(2).sum())
            sensitivity[slot] = change / abs(current - errors[other - 1])
        else:
            h1 = run(_seeds(1, set(members[slot]), 2))
            variance = 0.5 * float((h0 - h1).pow(2).sum())
            sensitivity[slot] = variance / max(current, 1e-30)
        measured.append(slot)
    # Ranks measured different examples: average what they measured, so all plan alike (the
    # stop above was agreed, so every rank measured the same slots).
    values = _average_across_ranks([sensitivity[s] for s in measured])
    sensitivity = dict(zip(measured, values))
    for slot, value in sensitivity.items():
        if not math.isfinite(value):
            raise ValueError(
                f"calibration: the sensitivity of slot {slot!r} came out {value}; no plan was "
                "installed. Calibrate on another batch"
            )
    flat = [e for s in items for e in (*recorder.errors[s][0], recorder.errors[s][1])]
    flat = _average_across_ranks(flat)
    for slot in items:
        count = len(recorder.errors[slot][0]) + 1
        recorder.errors[slot] = (flat[: count - 1], flat[count - 1])
        flat = flat[count:]
    _fill_unmeasured(handle, items, sensitivity)
    return sensitivity, measured


def _fill_unmeasured(handle, items, sensitivity: dict) -> None:
    """Items left unmeasured within the time cap take the median of their kind's."""
    for slot in items:
        if slot not in sensitivity:
            kind = handle.slots[slot]
            same = [v for s, v in sensitivity.items() if handle.slots[s] == kind]
            sensitivity[slot] = statistics.median(same or list(sensitivity.values()) or [1.0])


def _plan(handle, recorder, sensitivity, measured, target_bits, budget_bytes, start) -> BitPlan:
    config = handle.config
    items, numel, even = [], 0, 0
    for slot in _items(recorder):
        info = recorder.infos[slot]
        errors, _ = recorder.errors[slot]
        numel += info.numel
        even += info.nbytes
        if _is_fewbit(handle, slot):
            state, _ = handle._states[slot]
            allowed = (1,) if state.activation.exact else FEWBIT_CANDIDATES
            candidates = [
                Candidate(
                    {"bits": b}, (info.numel * b + 7) // 8 + 4, sensitivity[slot] * errors[b - 1]
                )
                for b in allowed
            ]
        else:
            candidates = [
                Candidate(
                    setting,
                    config.codec_for_setting(setting).nbytes(info.shape),
                    sensitivity[slot] * error,
                )
                for setting, error in zip(codec_candidates(handle, slot), errors)
            ]
        items.append(Item(slot, tuple(candidates)))
    budget = int(target_bits * numel / 8) if budget_bytes is None else int(budget_bytes)
    choice, met = allocate(items, budget)
    if not met:
        logger.warning(
            "hf_actq: %d bytes cannot hold these slots even at the lowest precision; each slot "
            "gets its cheapest setting (%d bytes)",
            budget,
            sum(c.nbytes for c in choice.values()),
        )
    even_setting = {"codec": config.codec, "bits": config.bits, "group_size": config.group_size}
    settings = {}
    for slot in handle.slots:
        info = recorder.infos.get(slot)
        leader = info.shared_with if info is not None and info.shared_with in choice else slot
        if leader in choice:
            settings[slot] = dict(choice[leader].setting)
        elif _is_fewbit(handle, slot):
            settings[slot] = {"bits": handle._states[slot][0].activation.bits}
        else:  # never filled on this batch (a frozen layer's input): the even setting
            settings[slot] = dict(even_setting)
    info = {
        "budget_bytes": budget,
        "bytes": sum(c.nbytes for c in choice.values()),
        "even_bytes": even,
        "elements": numel,
        "budget_met": met,
        "sensitivity": {s: sensitivity[s] for s in sorted(sensitivity)},
        "measured": len(measured),
        "estimated": len(sensitivity) - len(measured),
        "shared": {s: i.shared_with for s, i in recorder.infos.items() if i.shared_with},
        "seconds": round(time.perf_counter() - start, 3),
    }
    return BitPlan(settings, target_bits, info)


def list_slots(handle, batch) -> dict[str, SlotInfo]:
    """Every slot one forward on ``batch`` fills, with its shape, codec and bytes (the RNG is
    left as it was; nothing is kept)."""
    recorder = _Recorder(handle, measure=False)
    with torch.random.fork_rng(), observe(recorder), slot_seeds(_seeds(1)), torch.enable_grad():
        out = handle.model(**batch) if isinstance(batch, dict) else handle.model(batch)
        del out
    return recorder.infos


# ALAM as published (sensitivity="alam") ------------------------------------------------------
def _alam_items(handle, recorder) -> dict[str, list[str]]:
    """The tensors ALAM allocates, each with the slots that share it: every codec slot that
    packed its own tensor, and standalone activations (their input, under a codec). Few-bit
    codes that cannot be a codec (a gated MLP's activation, ReLU's exact bit) stay as they are."""
    items: dict[str, list[str]] = {}
    for slot, info in recorder.infos.items():
        state, name = handle._states[slot]
        if name == "act" and not state.act_codec:
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


def _measure_alam(handle, items, run, start, seconds):
    """ALAM's GradNormVar, as its code runs it: each tensor at AQ 0.5 bit with two rounding
    seeds and at 8 bits, every other at its current precision (uniform 4 bits before the first
    plan); ``alam.sensitivity`` of the three per-parameter gradient-norm vectors."""
    config = handle.config

    def codec(precision):
        return config.codec_for_setting(alam.SETTINGS[precision])

    members = [slot for group in items.values() for slot in group]
    context = {} if handle.plan is not None else dict.fromkeys(members, codec(4))
    sensitivity: dict[str, float] = {}
    measured: list[str] = []
    with _overridden(handle, context):
        for leader, group in items.items():
            if _all_ranks_agree_to_stop(time.perf_counter() - start > seconds):
                break
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
    return sensitivity, measured


def _alam_plan(handle, recorder, items, sensitivity, measured, target_bits, budget_bytes, start):
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
        counted += info.numel * info.dtype.itemsize if codec is None else codec.nbytes(info.shape)
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
