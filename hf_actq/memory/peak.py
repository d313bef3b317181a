"""Peak memory of a region of code, measured from the allocator, not estimated.

On CUDA the caching allocator's counters are exact: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``. On CPU there is no such counter and RSS is dominated by the
allocator's caching and the Python heap, so :class:`PeakMemory` runs the region under the
PyTorch profiler with ``profile_memory=True``, which records every allocation and free that goes
through PyTorch's CPU allocator; the running sum of those events, in time order, gives the bytes
live above the starting point at every instant, and its maximum is the peak. Only tensors are
counted (which is what a GPU would hold), never interpreter or library overhead. The profiler
cannot size the free of a tensor allocated before it started, so such frees are left out and the
CPU figures are upper bounds for regions that free older tensors; measure from a settled state
(e.g. gradients set to None before the step, as the memory report does).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch._C._autograd import DeviceType


class PeakMemory:
    """``with PeakMemory(device) as peak: step()``; then ``peak.peak_bytes`` (most bytes live at
    once above what was live on entry), ``peak.end_bytes`` (live on exit minus on entry) and,
    on CPU, ``peak.largest_bytes`` (the largest single allocation)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0
        self.largest_bytes: int | None = None  # the largest single allocation (CPU only)
        self._profiler = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _native_stderr_silenced():
                self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._start
            return
        with _native_stderr_silenced():
            self._profiler.__exit__(*exc)
        # The raw events hold one "[memory]" record per allocation (+bytes) and free (-bytes);
        # the aggregated event list folds them into the enclosing op and loses their order.
        live = peak = 0
        events = sorted(_cpu_memory_events(self._profiler))
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        self.peak_bytes, self.end_bytes = peak, live
        self.largest_bytes = max((nbytes for _, nbytes in events), default=0)
        self._profiler = None


def _cpu_memory_events(profiler) -> list[tuple[int, int]]:
    events = []
    for event in profiler.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
            events.append((event.start_ns(), event.nbytes()))
    return events


@contextlib.contextmanager
def _native_stderr_silenced():
    """Kineto prints "profiler_start/stop" lines from C++ straight to file descriptor 2."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # pytest capture, notebooks
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
