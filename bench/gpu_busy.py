"""How busy the GPU was during a run: the union of its kernels' execution intervals / wall time.

A separate pass under torch.profiler (CUDA activity only) collects every kernel's start and
end; overlapping kernels (several streams) count once, gaps (the GPU waiting on the host)
count as idle. The profiler adds a little host time per launch, so the busy fraction of a
profiled pass is a slight underestimate of an unprofiled one's; the timed passes of a
benchmark are never the profiled one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from tandem.workers.device_peaks import sync


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by `intervals` ((start, end) pairs), overlaps counted once."""
    total = 0.0
    covered_to = float("-inf")
    for start, end in sorted(intervals):
        if end <= covered_to:
            continue
        total += end - max(start, covered_to)
        covered_to = end
    return total


def busy_fraction(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """Union of the busy intervals over the wall time (same unit); 0 for an empty run."""
    return union_length(intervals) / wall if wall > 0 else 0.0


def profiled_busy_fraction(run: Callable[[], object], device: torch.device) -> float:
    """Run `run()` once under the profiler; the fraction of its wall time the GPU spent in kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter_ns()
        run()
        sync(device)
        wall_ns = time.perf_counter_ns() - start
    # The raw events: building the profiler's FunctionEvents for ~10^6 kernels takes minutes.
    events = prof.profiler.kineto_results.events()
    kernels = [(e.start_ns(), e.end_ns()) for e in events
               if e.device_type() == DeviceType.CUDA and not e.name().startswith(_NOT_KERNELS)]
    return busy_fraction(kernels, wall_ns)


# The GPU-side events that are copies, not kernels (kineto's names for them).
_NOT_KERNELS = ("Memcpy", "Memset")
