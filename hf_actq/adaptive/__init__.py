"""Adaptive precision (ALAM): per-slot sensitivity (GradNormVar), greedy bit allocation to a
byte budget, and bit plans."""

from hf_actq.adaptive.plan import BitPlan

__all__ = ["BitPlan"]
