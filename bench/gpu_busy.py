"""How busy the GPU was during a run, and where it waited: its kernels' execution intervals.

A separate pass under torch.profiler (CUDA activity only) collects every kernel's start and
end; overlapping kernels (several streams) count once, gaps (the GPU waiting on the host)
count as idle. The profiler adds a little host time per launch, so the busy fraction of a
profiled pass is a slight underestimate of an unprofiled one's; the timed passes of a
benchmark are never the profiled one.

Where the idle time is says what to fix, so the gaps are reported too: the edges (before the
first kernel and after the last: request intake, the final outputs), and the gaps between
kernels by size. Inside a CUDA graph kernels follow each other within a few microseconds; a
gap of hundreds of microseconds is a step's host work the device waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from tandem.bench.report import Figures
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


# Gap sizes in microseconds: (label, upper bound). Launch latency; a short host wait; a step's
# host work; longer stalls.
GAP_BUCKETS_US = (("under_20us", 20.0), ("20_200us", 200.0), ("200us_2ms", 2000.0), ("over_2ms", float("inf")))


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """`intervals` as disjoint, sorted (start, end) pairs (overlapping or touching ones joined)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def idle_figures(intervals_ns: Iterable[tuple[float, float]], wall_ns: float, top: int = 5) -> Figures:
    """Where the device idled: `gpu_idle_edges_ms` (the wall time outside the first kernel's start
    to the last one's end), per gap size the gaps' count and total ms (`gpu_gaps_<size>_count`,
    `gpu_gaps_<size>_ms`), and the `top` largest gaps as [ms, where in the span (0 = first kernel,
    1 = last)]."""
    busy = merged(intervals_ns)
    fig: Figures = {}
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    fig["gpu_idle_edges_ms"] = (wall_ns - span) / 1e6
    gaps = [(nxt[0] - cur[1], cur[1]) for cur, nxt in zip(busy, busy[1:])]
    lower = 0.0
    for label, upper in GAP_BUCKETS_US:
        sizes = [g for g, _ in gaps if lower * 1e3 <= g < upper * 1e3]
        fig[f"gpu_gaps_{label}_count"] = len(sizes)
        fig[f"gpu_gaps_{label}_ms"] = sum(sizes) / 1e6
        lower = upper
    largest = sorted(gaps, reverse=True)[:top]
    fig["gpu_largest_gaps"] = [[g / 1e6, (at - busy[0][0]) / span] for g, at in largest]
    return fig


# Kernel names as the table shows them: C++ template kernels (cuBLAS, CUTLASS) run to hundreds
# of characters, and their first ones name them.
KERNEL_NAME_CHARS = 90


def kernel_table(kernels: Iterable[tuple[str, float, float]], num_passes: int = 1, top: int = 15) -> list[list]:
    """The `top` kernels by total time, as [name, launches per pass, mean us, share of all kernel
    time]: what a pass is made of, so the next fusion can be chosen by what it would remove.
    `kernels`: (name, start ns, end ns); `num_passes` divides the launch counts."""
    by_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        entry = by_name.setdefault(name[:KERNEL_NAME_CHARS], [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    total = sum(ns for _, ns in by_name.values())
    rows = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return [[name, count / max(1, num_passes), ns / count / 1e3, ns / total if total else 0.0]
            for name, (count, ns) in rows]


def profiled_gpu_figures(run: Callable[[], object], device: torch.device, num_passes: int = 1) -> Figures:
    """Run `run()` once under the profiler: `gpu_busy` (the fraction of its wall time the GPU
    spent in kernels), `gpu_kernels` (how many ran), where it idled (`idle_figures`), the
    kernels that took the time (`gpu_kernel_table`, launches per one of `num_passes` passes) and
    `gpu_profiled_wall_ms` (the profiler adds host time per launch, so a caller can set it
    against the same work unprofiled)."""
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
    named = [(e.name(), e.start_ns(), e.end_ns()) for e in events
             if e.device_type() == DeviceType.CUDA and not e.name().startswith(_NOT_KERNELS)]
    kernels = [(start, end) for _, start, end in named]
    return {"gpu_busy": busy_fraction(kernels, wall_ns), "gpu_kernels": len(kernels), **idle_figures(kernels, wall_ns),
            "gpu_kernel_table": kernel_table(named, num_passes), "gpu_profiled_wall_ms": wall_ns / 1e6}


# The GPU-side events that are copies, not kernels (kineto's names for them).
_NOT_KERNELS = ("Memcpy", "Memset")
