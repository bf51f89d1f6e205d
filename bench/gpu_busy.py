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

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tandem.bench.host_timeline import PARTS, HostTimeline, Interval, attribute_gaps, flat_segments
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


def idle_gaps(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) of every stretch between two of `busy` (`merged` intervals), in order."""
    return [(cur[1], nxt[0]) for cur, nxt in zip(busy, busy[1:])]


def idle_figures(intervals_ns: Iterable[tuple[float, float]], wall_ns: float, top: int = 5) -> Figures:
    """Where the device idled: `gpu_idle_edges_ms` (the wall time outside the first kernel's start
    to the last one's end), per gap size the gaps' count and total ms (`gpu_gaps_<size>_count`,
    `gpu_gaps_<size>_ms`), and the `top` largest gaps as [ms, where in the span (0 = first kernel,
    1 = last)]."""
    busy = merged(intervals_ns)
    fig: Figures = {}
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    fig["gpu_idle_edges_ms"] = (wall_ns - span) / 1e6
    gaps = [(end - start, start) for start, end in idle_gaps(busy)]
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


def profiled_gpu_figures(run: Callable[[], object], device: torch.device, num_passes: int = 1,
                         engine: Any = None) -> Figures:
    """Run `run()` once under the profiler: `gpu_busy` (the fraction of its wall time the GPU
    spent in kernels), `gpu_kernels` (how many ran), where it idled (`idle_figures`), the
    kernels that took the time (`gpu_kernel_table`, launches per one of `num_passes` passes) and
    `gpu_profiled_wall_ms` (the profiler adds host time per launch, so a caller can set it
    against the same work unprofiled). With the `engine` that `run` drives, its host work is
    recorded too (`HostTimeline`) and the gaps are set against it (`host_figures`; `gpu_host_clock`
    says how the two clocks were lined up), and the caching allocator's device calls in the pass
    are counted (`allocator_figures`). `gpu_runtime_calls`: the host's CUDA API calls in the
    pass, by the time they took (`runtime_call_table`), and `gpu_largest_gaps_calls` what they
    were doing in the largest gaps (`gap_calls`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    timeline = HostTimeline(engine) if engine is not None else None
    allocator = torch.cuda.memory_stats(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        marks = [_marked_sync(device)]  # host-clock bounds of a cudaDeviceSynchronize: the clocks' offset
        epoch_offset = time.time_ns() - time.perf_counter_ns()
        start = time.perf_counter_ns()
        with timeline or contextlib.nullcontext():
            run()
        sync(device)
        wall_ns = time.perf_counter_ns() - start
        marks.append(_marked_sync(device))
    # The raw events: building the profiler's FunctionEvents for ~10^6 kernels takes minutes.
    events = prof.profiler.kineto_results.events()
    named = [(e.name(), e.start_ns(), e.end_ns()) for e in events
             if e.device_type() == DeviceType.CUDA and not e.name().startswith(_NOT_KERNELS)]
    kernels = [(start, end) for _, start, end in named]
    # With CUDA activity alone, the host-side events are the runtime's and the driver's calls.
    calls = [(e.name(), e.start_ns(), e.end_ns()) for e in events if e.device_type() == DeviceType.CPU]
    fig = {"gpu_busy": busy_fraction(kernels, wall_ns), "gpu_kernels": len(kernels),
           **idle_figures(kernels, wall_ns), "gpu_kernel_table": kernel_table(named, num_passes),
           "gpu_runtime_calls": runtime_call_table(calls), "gpu_largest_gaps_calls": gap_calls(kernels, calls),
           "gpu_profiled_wall_ms": wall_ns / 1e6, **allocator_figures(allocator, torch.cuda.memory_stats(device))}
    if timeline is not None:
        try:
            syncs = sorted(e.start_ns() for e in events
                           if e.device_type() == DeviceType.CPU and e.name() == "cudaDeviceSynchronize")
            offset, clock = clock_offset(marks, syncs), "synchronize"
            if offset is None:  # the profiler's events carry Unix-epoch times (kineto's clock)
                offset, clock = epoch_offset, "epoch"
            fig.update(host_figures(kernels, timeline.intervals, offset), gpu_host_clock=clock)
        except Exception as exc:  # noqa: BLE001 - a diagnostic's failure must not cost the pass's figures
            fig.update(dict.fromkeys(HOST_FIGURES), gpu_host_clock=f"failed: {type(exc).__name__}: {exc}")
    return fig


def _marked_sync(device: torch.device) -> tuple[int, int]:
    before = time.perf_counter_ns()
    sync(device)
    return before, time.perf_counter_ns()


def clock_offset(marks: list[tuple[int, int]], syncs: list[int]) -> float | None:
    """The profiler's clock minus perf_counter's, from the first and last cudaDeviceSynchronize
    the profiler saw (`syncs`, its clock) and the host-clock bounds of the calls that made them
    (`marks`): the mean of the two estimates, or None when they are missing or disagree by more
    than 100 us (the clocks are not one clock moved by a constant)."""
    if len(syncs) < 2 or len(marks) != 2:
        return None
    first, last = syncs[0] - marks[0][0], syncs[-1] - marks[1][0]
    return (first + last) / 2 if abs(first - last) <= 100_000 else None


# The gaps set against the host's parts: longer than a launch's latency.
HOST_GAP_MIN_NS = 20_000
HOST_FIGURES = (*(f"gpu_gap_ms_under_{part}" for part in PARTS), "gpu_largest_gaps_host")


def host_figures(kernels: Iterable[tuple[float, float]], intervals: list[Interval], offset_ns: float | None,
                 top: int = 5) -> Figures:
    """The GPU's gaps of `HOST_GAP_MIN_NS` or more set against the host's parts: ms of gap under
    each (`gpu_gap_ms_under_<part>`) and, for the `top` largest gaps, [ms, the part that covers
    most of it, what that part was doing] (`gpu_largest_gaps_host`); None where the two clocks
    could not be lined up."""
    if offset_ns is None:
        return dict.fromkeys(HOST_FIGURES)
    gaps = [(start, end) for start, end in idle_gaps(merged(kernels)) if end - start >= HOST_GAP_MIN_NS]
    totals, dominant = attribute_gaps(gaps, flat_segments(intervals), offset_ns)
    order = sorted(range(len(gaps)), key=lambda i: gaps[i][0] - gaps[i][1])[:top]
    largest = [[(gaps[i][1] - gaps[i][0]) / 1e6, *dominant[i]] for i in order]
    return dict(zip(HOST_FIGURES, [totals[part] for part in PARTS] + [largest], strict=True))


# The caching allocator's counters whose growth during a run means device calls mid-run: a
# retry frees every cached block (cudaFree synchronises the device) and allocates again.
_ALLOCATOR_COUNTERS = (("gpu_alloc_retries", "num_alloc_retries"), ("gpu_device_mallocs", "num_device_alloc"),
                       ("gpu_device_frees", "num_device_free"))
ALLOCATOR_FIGURES = tuple(name for name, _ in _ALLOCATOR_COUNTERS)


def allocator_figures(before: dict[str, Any], after: dict[str, Any]) -> Figures:
    """How many allocator retries, cudaMallocs and cudaFrees a run made (`torch.cuda.memory_stats`
    before and after it; None for a counter this torch does not keep)."""
    return {name: (after[key] - before[key]) if key in before and key in after else None
            for name, key in _ALLOCATOR_COUNTERS}


# The GPU-side events that are copies, not kernels (kineto's names for them).
_NOT_KERNELS = ("Memcpy", "Memset")


def runtime_call_table(calls: Iterable[tuple[str, float, float]], top: int = 12) -> list[list]:
    """The host's CUDA runtime and driver calls of a pass, (name, start, end) in ns, by the host
    time they took: [name, calls, total ms, longest us]. A cudaStreamSynchronize or a blocking
    cudaMemcpy here is a wait the engine did not mean (its own is one cudaEventSynchronize a
    step); cudaHostAlloc, cudaMalloc and cudaFree are slow calls that may stall the device."""
    by_name: dict[str, list[float]] = {}
    for name, start, end in calls:
        entry = by_name.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        entry[2] = max(entry[2], end - start)
    rows = sorted(by_name.items(), key=lambda item: (-item[1][1], item[0]))[:top]
    return [[name, int(count), ns / 1e6, longest / 1e3] for name, (count, ns, longest) in rows]


def gap_calls(kernels: Iterable[tuple[float, float]], calls: list[tuple[str, float, float]],
              top: int = 5) -> list[list]:
    """For the `top` largest gaps between kernels, what the host's CUDA calls (the profiler's
    clock, the kernels' own) were doing: [gap ms, the call that overlapped the gap longest as
    [name, us of overlap] (None: the host made no CUDA call then, so it was in Python), the
    last call begun before the gap ended as [name, us into the gap it began] (the launch the
    device waited for, usually)]."""
    gaps = sorted(idle_gaps(merged(kernels)), key=lambda gap: gap[0] - gap[1])[:top]
    out = []
    for start, end in gaps:
        longest: list | None = None
        ender: list | None = None
        for name, c_start, c_end in calls:
            overlap = min(end, c_end) - max(start, c_start)
            if overlap > 0 and (longest is None or overlap / 1e3 > longest[1]):
                longest = [name, overlap / 1e3]
            if c_start < end and (ender is None or c_start >= ender[2]):
                ender = [name, (c_start - start) / 1e3, c_start]
        out.append([(end - start) / 1e6, longest, ender[:2] if ender is not None else None])
    return out
