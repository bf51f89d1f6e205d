"""The garbage collector's young generation, sized for a serving process.

CPython collects its youngest generation each time 700 more container objects have been
made than freed. A serving process makes and frees thousands each step (a step's outputs,
each stream's deltas, each flush's rows), so at the default it collects several times a
step, and each collection walks whatever of the step is still alive (the deltas waiting to
be sent) only to promote it into the older generations, whose collections walk more.
Objects that live for a step die by reference counting before a collection sees them once
the threshold is a few steps' worth; garbage in cycles waits a little longer for its
collection, which is all the threshold changes.

Serve's own HTTP proxy raises its threshold for the same reason (`RAY_SERVE_PROXY_GC_THRESHOLD`).
`TANDEM_GC_YOUNG_THRESHOLD` sets ours (700 restores CPython's default; figures in
bench/RESULTS.md).
"""

from __future__ import annotations

import gc
import os

YOUNG_THRESHOLD = 10_000


def widen_young_generation() -> int:
    """Collect the young generation every `TANDEM_GC_YOUNG_THRESHOLD` (default 10,000) net
    allocations instead of 700, the older generations' thresholds unchanged; returns it."""
    threshold = int(os.environ.get("TANDEM_GC_YOUNG_THRESHOLD", YOUNG_THRESHOLD))
    if threshold < 1:
        raise ValueError(f"TANDEM_GC_YOUNG_THRESHOLD: must be at least 1, not {threshold}")
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)
    return threshold
