"""Greedy allocation of precision to slots under a byte budget (ALAM section 5, Eq. 4).

Each item (a slot, or slots sharing one packed tensor) has candidate settings, each with the
bytes it keeps (counted as the meter counts them: codes and metadata) and a predicted gradient
variance. ALAM's bound is ``sum_l c_l (2^b_l - 1)^-2``; here the factor ``(2^b - 1)^-2`` is
replaced by each candidate's measured error on the slot's own tensor, which covers average
quantization and few-bit tables too (see :mod:`hf_actq.adaptive.calibrate`).

Every item starts at its most expensive candidate; while the total exceeds the budget, the
move with the least added variance per byte saved is taken (to any cheaper candidate of an
item, so candidates that are not ordered by cost are handled). Ties go to the item listed
first, so the result depends only on the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    setting: dict
    nbytes: int
    variance: float


@dataclass(frozen=True)
class Item:
    name: str
    candidates: tuple[Candidate, ...]


def allocate(items: list[Item], budget: int) -> tuple[dict[str, Candidate], bool]:
    """The chosen candidate per item, and whether the budget was met (when it cannot be, every
    item gets its cheapest candidate)."""
    choice = {
        item.name: max(item.candidates, key=lambda c: (c.nbytes, -c.variance)) for item in items
    }
    total = sum(c.nbytes for c in choice.values())
    while total > budget:
        best = None
        for item in items:
            current = choice[item.name]
            for candidate in item.candidates:
                saved = current.nbytes - candidate.nbytes
                if saved <= 0:
                    continue
                rate = (candidate.variance - current.variance) / saved
                if best is None or rate < best[0]:
                    best = (rate, item.name, candidate)
        if best is None:
            return choice, False
        _, name, candidate = best
        total -= choice[name].nbytes - candidate.nbytes
        choice[name] = candidate
    return choice, True
