"""Memory measurement: bytes autograd holds for backward, peak memory, and reports.

``SavedTensorMeter`` and ``graph_saved_bytes`` count activation memory two independent ways;
``PeakMemory`` measures peak allocation; ``hf_actq.memory.report`` measures models under several
recipes (``hf-actq memory``).
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
