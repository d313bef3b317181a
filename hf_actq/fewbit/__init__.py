"""Few-bit activation derivatives: the DP solver, the activation library and the shipped tables."""

from hf_actq.fewbit.activations import ACTIVATIONS, ALIASES, ActivationSpec, get_activation
from hf_actq.fewbit.dp import FewBitTable, optimal_table, optimal_tables
from hf_actq.fewbit.tables import shipped_tables, table_for

__all__ = [
    "ACTIVATIONS",
    "ALIASES",
    "ActivationSpec",
    "FewBitTable",
    "get_activation",
    "optimal_table",
    "optimal_tables",
    "shipped_tables",
    "table_for",
]
