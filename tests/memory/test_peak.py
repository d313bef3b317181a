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


def test_a_free_is_sized_only_from_an_allocation_seen_in_the_region():
    # torch's CPU allocator keeps the size of every block allocated under a profiler until that
    # block is freed under a profiler; a block that outlives one region leaves a stale entry, and a
    # later block at the same address freed inside another region would be subtracted with the
    # stale size (CI once saw end_bytes 0 here). The address is reused by malloc most of the time,
    # so the scenario is repeated.
    for _ in range(10):
        with PeakMemory("cpu"):
            outliving = torch.empty(1_000_000)
        del outliving  # freed with no profiler running: its size entry stays behind
        before = torch.empty(2_000_000)  # usually lands at the same address
        with PeakMemory("cpu") as peak:
            del before
            kept = torch.empty(1_000_000)
        assert peak.peak_bytes == peak.end_bytes == kept.untyped_storage().nbytes()


def test_phases_split_the_peak_where_they_were_marked():
    with PeakMemory("cpu", phase="first") as peak:
        kept = torch.empty(1_000_000)  # 4 MB, live through every later phase
        transient = torch.empty(10_000_000)  # 40 MB, only in the first phase
        del transient
        peak.mark("second")
        second = torch.empty(2_000_000)  # 8 MB
        del second
        peak.mark("third")  # nothing allocated: its peak is what was live when it began
        peak.mark("first")  # a phase marked again keeps its larger peak
    size = kept.untyped_storage().nbytes()
    assert list(peak.phase_peaks) == ["first", "second", "third"]
    assert 44_000_000 <= peak.phase_peaks["first"] < 44_000_000 + 1_000
    assert 12_000_000 <= peak.phase_peaks["second"] < 12_000_000 + 1_000
    assert peak.phase_peaks["third"] == size
    assert peak.peak_bytes == max(peak.phase_peaks.values())
    peak.mark("outside")  # after the region: ignored
    assert "outside" not in peak.phase_peaks


def test_freeing_an_older_tensor_under_it_prints_nothing():
    """torch warns from C++, once a process, when a block allocated before a profiler started
    is freed under it: the memory report's output showed that line. The region takes it,
    silenced, when it starts. A fresh process: the warning is once a process."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from hf_actq.memory import PeakMemory\n"
        "old = [torch.randn(1000) for _ in range(3)]\n"
        "for _ in range(3):\n"
        "    with PeakMemory('cpu'):\n"
        "        old.pop()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stderr == "", result.stderr
