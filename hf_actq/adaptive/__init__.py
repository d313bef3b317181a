"""Adaptive precision as ALAM publishes it: per-tensor sensitivity (GradNormVar), its allocation
to a target average of code bits, and bit plans."""

from hf_actq.adaptive.plan import BitPlan

__all__ = ["BitPlan"]
