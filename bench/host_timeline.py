"""The engine's host work on a timeline, so the GPU's idle gaps can be set against it.

While a `HostTimeline` is entered, each `GroupEngine.step()` call's parts are recorded with
`time.perf_counter_ns()`:

- `launch`: scheduling the next step, building its inputs and launching its forward (graph
  replays, or an eager step's kernels one by one from Python);
- `wait`: blocked on a step's output (`PendingOutput.result()`: the device finishing the
  step, then the sampled ids turned into a `RunnerOutput`);
- `update`: the rest of collecting that step (the scheduler's update, the engine's figures);
- `emit`: text, stop strings and outputs;
- `step`: the rest of `step()` itself; and `outside` (no interval): the caller's loop.

Nested parts win over the part around them (`flat_segments`), so every instant of the run
has one label. `gpu_busy.py` sets each idle gap of the GPU against these segments: a gap under
`launch` is the GPU waiting for the next step's host work; under `emit` or `update`, for output
processing that did not overlap the device.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.workers.core.scheduler_output import PendingOutput

PARTS = ("launch", "wait", "update", "emit", "step", "outside")


@dataclass(frozen=True)
class Interval:
    """One recorded part: [start, end) in perf_counter ns, its label, and what it was doing
    (for `launch`: the step it launched)."""
    start: int
    end: int
    label: str
    what: str = ""


def describe_step(sched_out: Any) -> str:
    """A launched step in a few words: requests, tokens, prompt chunks and passes."""
    sched = sched_out.num_scheduled_tokens
    chunks = sum(1 for n in sched.values() if n != 1)
    passes = f", {sched_out.num_steps} passes" if sched_out.num_steps > 1 else ""
    return f"{len(sched)} requests, {sched_out.total_num_scheduled_tokens} tokens, {chunks} prompt chunks{passes}"


@dataclass
class HostTimeline:
    """Records `engine`'s parts while entered (the wrappers are removed on exit)."""
    engine: Any
    intervals: list[Interval] = field(default_factory=list)

    def _wrap(self, label: str, fn: Callable[..., Any], what: Callable[[], str] | None = None) -> Callable[..., Any]:
        record = self.intervals.append

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                record(Interval(start, time.perf_counter_ns(), label, what() if what is not None else ""))
        return timed

    def _launched(self) -> str:
        in_flight = self.engine._in_flight
        return describe_step(in_flight[-1][0]) if in_flight else "nothing to launch"

    def __enter__(self) -> HostTimeline:
        engine = self.engine
        engine.step = self._wrap("step", engine.step)
        engine._launch = self._wrap("launch", engine._launch, self._launched)
        engine._collect = self._wrap("update", engine._collect)
        engine._emit = self._wrap("emit", engine._emit)
        self._result = PendingOutput.result
        PendingOutput.result = self._wrap("wait", self._result)
        return self

    def __exit__(self, *exc: object) -> None:
        PendingOutput.result = self._result
        for name in ("step", "_launch", "_collect", "_emit"):
            self.engine.__dict__.pop(name, None)  # the class's method again


def flat_segments(intervals: Iterable[Interval]) -> list[Interval]:
    """Nested or disjoint intervals as disjoint, sorted segments, each labelled by the innermost
    interval holding it (time outside every interval is left out)."""
    events = sorted(intervals, key=lambda i: (i.start, -i.end))
    out: list[Interval] = []
    stack: list[Interval] = []
    cursor = 0

    def emit_until(t: int) -> None:
        nonlocal cursor
        while stack and stack[-1].end <= t:  # close the intervals that end first, innermost out
            top = stack.pop()
            if top.end > cursor:
                out.append(Interval(cursor, top.end, top.label, top.what))
                cursor = top.end
        if stack and t > cursor:
            top = stack[-1]
            out.append(Interval(cursor, t, top.label, top.what))
        cursor = max(cursor, t)

    for interval in events:
        emit_until(interval.start)
        stack.append(interval)
    emit_until(max((i.end for i in events), default=0) + 1)
    return [s for s in out if s.end > s.start]


def attribute_gaps(gaps: Iterable[tuple[float, float]], segments: list[Interval], offset_ns: float
                   ) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """Each gap ((start, end) in the GPU's clock) split over the host segments it overlaps
    (`offset_ns` = GPU clock - perf_counter): ms per part (`outside` for time in no segment),
    and per gap the part that covers most of it, with what that part was doing."""
    starts = [s.start for s in segments]
    totals = dict.fromkeys(PARTS, 0.0)
    dominant: list[tuple[str, str]] = []
    for gpu_start, gpu_end in gaps:
        a, b = gpu_start - offset_ns, gpu_end - offset_ns
        covered = 0.0
        best = ("outside", "", 0.0)
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(segments) and segments[i].start < b:
            seg = segments[i]
            overlap = min(b, seg.end) - max(a, seg.start)
            if overlap > 0:
                totals[seg.label] += overlap / 1e6
                covered += overlap
                if overlap > best[2]:
                    best = (seg.label, seg.what, overlap)
            i += 1
        outside = (b - a) - covered
        totals["outside"] += outside / 1e6
        if outside > best[2]:
            best = ("outside", "", outside)
        dominant.append(best[:2])
    return totals, dominant
