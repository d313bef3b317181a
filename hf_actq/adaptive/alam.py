"""ALAM's own sensitivity and allocation, as its official implementation computes them
(alam-iclr2024 Algorithm 2 and section 5; the authors' code, read for its arithmetic), for the
"alam" recipe to follow them step for step. Pure functions of measured numbers; the passes that
measure them are in :mod:`hf_actq.adaptive.calibrate`.

**Sensitivity.** Each saved tensor is measured three times while every other keeps its current
precision: at AQ 0.5 bit (means of 4 at 2 bits) with one rounding seed (``g0``), with another
(``g1``), and at 8-bit uniform rounding (``g2``); each ``g`` is the vector of per-parameter
gradient norms (GradNormVar). The sensitivity is ``max(d01, 2 max(d02, d12))`` with ``dij`` the
squared distance of ``gi`` and ``gj``: the seed-to-seed change sees rounding noise, the change
against 8 bits also sees averaging's bias, which no seed changes. A measurement that is not
finite, or above 1e10, counts as 1e10 (the tensor is kept as precise as the budget allows).

**Allocation.** Precisions form a ladder, exact (counted as 32 bits) -> 8 -> 4 -> 2 -> AQ 0.5;
the predicted variance of a tensor at ``b`` bits is ``C / (2^b - 1)^2``, with AQ taken as ``b =
1`` and exact as no variance. Every tensor starts exact; while the code bits exceed
``target_bits`` times the elements, the tensor whose next step down adds the least variance per
bit per element takes it. Only code bits count (no scales, no masks). One quirk kept for
faithfulness: the step from 2 bits to AQ saves 1.5 bits per element but is ranked as if it saved
1, so averaging is taken later than its true saving would justify. Ties go to the tensor listed
last.
"""

from __future__ import annotations

import heapq
import math

# The ladder of precisions, most precise first; "aq" is AQ 0.5 bit (groups of 4 at 2 bits).
LADDER = ("exact", 8, 4, 2, "aq")
# Code bits per element at each precision (ALAM counts an exact tensor as 32 bits).
BITS = {"exact": 32.0, 8: 8.0, 4: 4.0, 2: 2.0, "aq": 0.5}
# The bits each step down is ranked by (2 -> AQ: 1, the quirk above).
_RANKED_STEP = {"exact": 24.0, 8: 4.0, 4: 2.0, 2: 1.0}
# The ``b`` of the variance factor (2^b - 1)^-2.
_VARIANCE_BITS = {8: 8, 4: 4, 2: 2, "aq": 1}
# What counts as "too large to trust" and replaces a non-finite measurement.
CAP = 1e10
# Settings of our codecs for each precision (exact: the slot kept as it is).
SETTINGS = {
    "exact": {"codec": "exact"},
    8: {"codec": "uniform", "bits": 8},
    4: {"codec": "uniform", "bits": 4},
    2: {"codec": "uniform", "bits": 2},
    "aq": {"codec": "aq", "bits": 0.5, "group_size": 4},
}


def sensitivity(g0, g1, g2) -> float:
    """``max(d01, 2 max(d02, d12))`` of three per-parameter gradient-norm vectors (sequences
    of floats or 1-D tensors of equal length), capped at :data:`CAP`."""
    a, b, c = (_floats(g) for g in (g0, g1, g2))
    if not len(a) == len(b) == len(c):
        raise ValueError(
            f"the three gradient-norm vectors must have one entry per parameter, got "
            f"{len(a)}, {len(b)} and {len(c)}"
        )

    def distance(x, y):
        return sum((p - q) ** 2 for p, q in zip(x, y))

    value = max(distance(a, b), 2 * max(distance(a, c), distance(b, c)))
    return value if math.isfinite(value) and value <= CAP else CAP


def _floats(values) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


def variance(c: float, precision) -> float:
    """The predicted gradient variance of a tensor of sensitivity ``c`` at ``precision``."""
    if precision == "exact":
        return 0.0
    return c / (2 ** _VARIANCE_BITS[precision] - 1) ** 2


def allocate(sensitivities: dict[str, float], elements: dict[str, int], target_bits: float):
    """Precision per tensor (a :data:`LADDER` entry) so that the code bits are at most
    ``target_bits`` per element on average, by ALAM's greedy steps (see the module). Returns
    ``(precisions, bits)``: the choice, and the code bits it keeps in all. A target below AQ's
    0.5 bit leaves every tensor at AQ."""
    names = list(sensitivities)
    if set(names) != set(elements):
        raise ValueError("sensitivities and elements must name the same tensors")
    if not isinstance(target_bits, (int, float)) or not target_bits > 0:
        raise ValueError(f"target_bits must be a positive number, got {target_bits!r}")
    precision = dict.fromkeys(names, "exact")
    total = sum(BITS["exact"] * elements[name] for name in names)
    budget = target_bits * sum(elements[name] for name in names)
    queue: list[tuple[float, int, str]] = []

    def push(index: int, name: str) -> None:
        current = precision[name]
        if current == "aq" or elements[name] == 0:
            return
        following = LADDER[LADDER.index(current) + 1]
        added = variance(sensitivities[name], following) - variance(sensitivities[name], current)
        rank = added / (elements[name] * _RANKED_STEP[current])
        heapq.heappush(queue, (rank, -index, name))  # least added variance first; last listed

    for index, name in enumerate(names):
        push(index, name)
    index_of = {name: index for index, name in enumerate(names)}
    while total > budget and queue:
        _, _, name = heapq.heappop(queue)
        current = precision[name]
        following = LADDER[LADDER.index(current) + 1]
        total -= (BITS[current] - BITS[following]) * elements[name]
        precision[name] = following
        push(index_of[name], name)
    return precision, total
