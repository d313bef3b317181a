"""PeakMemory on CPU follows the allocator, so transient and kept tensors show exactly."""

import torch

from hf_actq.memory import PeakMemory


def test_transient_allocation_sets_the_peak_and_freed_memory_leaves():
    with PeakMemory("cpu") as peak:
        kept = torch.empty(1_000_000)  # 4 MB
        transient = torch.empty(10_000_000)  # 40 MB
        del transient
    assert peak.peak_bytes >= 44_000_000
    assert peak.peak_bytes < 44_000_000 + 1_000_000
    assert abs(peak.end_bytes - kept.untyped_storage().nbytes()) < 1_000


def test_frees_of_older_tensors_are_not_seen_so_figures_are_upper_bounds():
    # The profiler never learnt the size of a block allocated before it started: its free is
    # dropped (documented in PeakMemory), never subtracted with a wrong size.
    before = torch.empty(2_000_000)
    with PeakMemory("cpu") as peak:
        del before
        kept = torch.empty(1_000_000)
    assert peak.peak_bytes == peak.end_bytes == kept.untyped_storage().nbytes()
