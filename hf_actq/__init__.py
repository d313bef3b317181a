"""hf_actq: compress the activations saved for backward in HuggingFace training."""

from hf_actq.adaptive import BitPlan
from hf_actq.config import ActQConfig
from hf_actq.fewbit import FewBitTable, optimal_table
from hf_actq.integrations.transformers import (
    MODEL_TYPE_TO_APPLY_FN,
    ActQHandle,
    apply,
    revert,
)
from hf_actq.memory import SavedTensorMeter
from hf_actq.ops import *  # noqa: F403
from hf_actq.ops import __all__ as _ops_all

__version__ = "0.1.0"

__all__ = [
    "MODEL_TYPE_TO_APPLY_FN",
    "ActQCallback",  # noqa: F405 (provided lazily by __getattr__)
    "ActQConfig",
    "ActQHandle",
    "BitPlan",
    "FewBitTable",
    "SavedTensorMeter",
    "apply",
    "optimal_table",
    "revert",
    *_ops_all,
]


def __getattr__(name):
    # The callback imports transformers' Trainer stack: load it only when asked for.
    if name == "ActQCallback":
        from hf_actq.integrations.trainer import ActQCallback

        return ActQCallback
    raise AttributeError(f"module 'hf_actq' has no attribute {name!r}")
