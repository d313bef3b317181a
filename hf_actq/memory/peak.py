"""Peak memory of a region of code, measured from the allocator, not estimated.

On CUDA the caching allocator's counters are exact: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``. On CPU there is no such counter and RSS is dominated by the
allocator's caching and the Python heap, so :class:`PeakMemory` runs the region under the
PyTorch profiler with ``profile_memory=True``, which records every allocation and free that goes
through PyTorch's CPU allocator; the running sum of those events, in time order, gives the bytes
live above the starting point at every instant, and its maximum is the peak. Only tensors are
counted (which is what a GPU would hold), never interpreter or library overhead. Frees of tensors
allocated before the region are left out (a free counts only when its address was allocated
inside the region), so the CPU figures are upper bounds for regions that free older tensors;
measure from a settled state (e.g. gradients set to None before the step, as the memory report
does).

``mark(name)`` splits the region into phases (forward, backward, optimizer step, ...) and
``phase_peaks`` holds each phase's peak, measured the same way: where the step's peak sits, and,
for the memory report, a peak per phase that can be extrapolated in depth on its own.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

# Phase boundaries on CPU: zero-length profiler ranges, ordered with the allocations by time.
_MARK_PREFIX = "hf_actq.peak_phase:"


class PeakMemory:
    """``with PeakMemory(device) as peak: step()``; then ``peak.peak_bytes`` (most bytes live at
    once above what was live on entry), ``peak.end_bytes`` (live on exit minus on entry) and,
    on CPU, ``peak.largest_bytes`` (the largest single allocation).

    ``peak.mark(name)`` inside the region starts a phase (the region opens in phase ``phase``);
    ``peak.phase_peaks`` maps each phase to the most bytes live above the entry during it, in
    the order the phases began (a name marked twice keeps its larger peak)."""

    def __init__(self, device: torch.device | str = "cpu", phase: str = "region"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0
        self.largest_bytes: int | None = None  # the largest single allocation (CPU only)
        self.phase_peaks: dict[str, int] = {}
        self._first_phase = self._phase = phase
        self._profiler = None
        self._start: int | None = None  # CUDA: bytes allocated on entry, while in the region

    def mark(self, name: str) -> None:
        """Ends the current phase and starts ``name``; a no-op outside the region."""
        if self.device.type == "cuda":
            if self._start is None:
                return
            # The allocator counts on the host, at allocation time: no synchronization needed.
            self._close_cuda_phase()
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._profiler is None:
            return
        else:
            with torch.profiler.record_function(_MARK_PREFIX + name):
                pass
        self._phase = name

    def __enter__(self) -> PeakMemory:
        self.phase_peaks, self._phase = {}, self._first_phase
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            primer = torch.empty(1)
            with _native_stderr_silenced():
                self._profiler.__enter__()
                # torch warns once a process, from C++ to file descriptor 2, when a block
                # allocated before a profiler started is freed under it: the region frees older
                # tensors, so have that warning here, silenced, and not in the report's output.
                del primer
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._close_cuda_phase()
            self.peak_bytes = max(self.phase_peaks.values())
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._start
            self._start = None
            return
        with _native_stderr_silenced():
            self._profiler.__exit__(*exc)
        live = peak = largest = 0
        phase = self._first_phase
        self.phase_peaks = {phase: 0}
        allocated_here: dict[int, int] = {}  # address -> bytes, for blocks allocated in the region
        for _, address, nbytes in sorted(_cpu_allocation_events(self._profiler), key=_time):
            if isinstance(address, str):  # a phase mark
                phase = address
                self.phase_peaks[phase] = max(self.phase_peaks.get(phase, live), live)
                continue
            if nbytes > 0:
                allocated_here[address] = nbytes
                largest = max(largest, nbytes)
            else:
                # torch's CPU allocator sizes a free from a table it fills only while a profiler
                # runs and does not clear when a block outlives the profiler, so a free of an older
                # block can carry another block's size; only frees of blocks we saw allocated count.
                nbytes = -allocated_here.pop(address, 0)
            live += nbytes
            peak = max(peak, live)
            self.phase_peaks[phase] = max(self.phase_peaks[phase], live)
        self.peak_bytes, self.end_bytes, self.largest_bytes = peak, live, largest
        self._profiler = None

    def _close_cuda_phase(self) -> None:
        phase_peak = torch.cuda.max_memory_allocated(self.device) - self._start
        self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), phase_peak)


def _time(event: tuple) -> int:
    return event[0]


def _cpu_allocation_events(profiler) -> list[tuple[int, int | str, int]]:
    """(time, address, +bytes allocated or -bytes freed) for every CPU allocator event, and
    (time, phase name, 0) for every phase mark, in any order; the aggregated event list would
    fold them into their ops and lose their order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif node.tag == _EventType.TorchOp and node.name.startswith(_MARK_PREFIX):
            events.append((node.start_time_ns, node.name.removeprefix(_MARK_PREFIX), 0))
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
