"""Memory measurement: the bytes autograd holds for backward, and a step's peak.

``SavedTensorMeter`` and ``graph_saved_bytes`` count activation memory two independent ways;
``PeakMemory`` measures peak allocation. The reports built on them are in ``hf_actq.report``.
"""

from hf_actq.memory.meter import (
    OP_KINDS,
    ActivationMonitor,
    SavedTensorMeter,
    graph_saved_bytes,
    graph_saved_tensors,
    op_kind,
)
from hf_actq.memory.peak import PeakMemory

__all__ = [
    "OP_KINDS",
    "ActivationMonitor",
    "PeakMemory",
    "SavedTensorMeter",
    "graph_saved_bytes",
    "graph_saved_tensors",
    "op_kind",
]
