"""hf_actq: compress the activations saved for backward in HuggingFace training."""

from hf_actq.fewbit import FewBitTable, optimal_table
from hf_actq.memory import SavedTensorMeter
from hf_actq.ops import *  # noqa: F403
from hf_actq.ops import __all__ as _ops_all

__version__ = "0.1.0"

__all__ = ["FewBitTable", "SavedTensorMeter", "optimal_table", *_ops_all]
