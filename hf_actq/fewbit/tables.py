"""Shipped few-bit tables and the lookup every op goes through.

The tables in ``tables.json`` are built by ``python -m hf_actq.fewbit.build_tables`` with
:data:`SHIPPED_SETTINGS` (the paper's uniform weight on [-10, 10]); each records its error.
Activations with non-default parameters (``elu`` with ``alpha=0.5``, ...) get their table
computed once per process by the same DP.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from hf_actq.fewbit.activations import get_activation, resolve_params
from hf_actq.fewbit.dp import MAX_BITS, FewBitTable, optimal_tables

logger = logging.getLogger(__name__)

TABLES_PATH = Path(__file__).with_name("tables.json")
SHIPPED_SETTINGS = {"interval": (-10.0, 10.0), "weight": "uniform", "num_points": 2000}


def validate_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in 1..{MAX_BITS}, got {bits!r}")
    return bits


@functools.cache
def shipped_tables() -> dict[tuple[str, int], FewBitTable]:
    data = json.loads(TABLES_PATH.read_text())
    return {
        (name, int(bits)): FewBitTable.from_dict(table)
        for name, by_bits in data["tables"].items()
        for bits, table in by_bits.items()
    }


def table_for(activation: str, bits: int, **params: float) -> FewBitTable:
    """The table few-bit ``activation`` uses at ``bits`` bits.

    Activations whose derivative takes two values (relu, leaky_relu, relu6, hardtanh,
    hardsigmoid) get their exact 1-bit table whatever ``bits`` asks for: more bits would add
    nothing.
    """
    spec = get_activation(activation)
    bits = validate_bits(bits)
    resolved = resolve_params(spec, params)
    if spec.exact is not None:
        borders, levels = spec.exact(**resolved)
        return FewBitTable(
            activation=spec.name,
            bits=1,
            borders=tuple(float(b) for b in borders),
            levels=tuple(float(v) for v in levels),
            error=0.0,
            params=resolved,
        )
    if resolved == spec.params:
        return shipped_tables()[(spec.table_name, bits)]
    return _computed_table(spec.name, bits, tuple(sorted(resolved.items())))


@functools.cache
def _computed_table(name: str, bits: int, params: tuple[tuple[str, float], ...]) -> FewBitTable:
    logger.info("computing the %d-bit few-bit table for %s%s", bits, name, dict(params))
    return optimal_tables(name, (bits,), **SHIPPED_SETTINGS, **dict(params))[bits]
