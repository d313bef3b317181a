"""hf_actq: compress the activations saved for backward in HuggingFace training.

The public API: ``apply(model, ActQConfig(...))`` and ``revert``, ``ActQCallback`` for
``Trainer``, ``BitPlan`` for adaptive plans, ``SavedTensorMeter`` and ``measure_model`` for memory.
The ops (``FewBitGELU``, ``CompressedLinear``, ...) are in ``hf_actq.ops``, the codecs in
``hf_actq.codecs``, the few-bit tables in ``hf_actq.fewbit``.
"""

from hf_actq.adaptive import BitPlan
from hf_actq.config import ActQConfig
from hf_actq.integrations.transformers import ActQHandle, apply, revert
from hf_actq.memory import SavedTensorMeter

__version__ = "0.1.0"

__all__ = [
    "ActQCallback",  # noqa: F822 (provided lazily by __getattr__)
    "ActQConfig",
    "ActQHandle",
    "BitPlan",
    "SavedTensorMeter",
    "apply",
    "measure_model",  # noqa: F822
    "revert",
]


def __getattr__(name):
    # The callback imports transformers' Trainer stack, the report the model builders: load
    # them only when asked for.
    if name == "ActQCallback":
        from hf_actq.integrations.trainer import ActQCallback

        return ActQCallback
    if name == "measure_model":
        from hf_actq.report import measure_model

        return measure_model
    raise AttributeError(f"module 'hf_actq' has no attribute {name!r}")
