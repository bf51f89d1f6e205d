"""IdleParking: a replica group's workers wait off the CPU while the group has no steps.

A worker's compiled-graph loop waits for the next step in Ray's shared-memory channel,
which polls (sched_yield in a loop): an idle group would keep one core per worker busy
for as long as it is idle, and on a small machine starve everything else on it. Once no
step has been in flight for `after_s`, the executor sends every worker a park message
(`Park`); each worker then blocks on an event until the executor unparks it, which it
does before the next step (one actor call per worker and the park's result: ~4 ms for four
workers on a 2-core machine, paid only by a step that follows `after_s` or more of idleness).

The executor calls `step_started` before it submits a step and `step_done` once it has
the step's result (or its failure); a thread of this class parks the workers in between.
All three hold one lock, so a park and a step are never submitted at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class IdleParking:
    def __init__(self, after_s: float, park: Callable[[], Any], unpark: Callable[[Any, float], None],
                 unpark_timeout_s: float) -> None:
        """`park()` sends the park message and returns its handle (the park's result to wait
        for); `unpark(handle, timeout_s)` wakes every worker and waits for that result."""
        if after_s <= 0:
            raise ValueError(f"park_workers_after_s: must be > 0, got {after_s}")
        self.after_s = after_s
        self._park = park
        self._unpark = unpark
        self._unpark_timeout_s = unpark_timeout_s
        self._cond = threading.Condition()
        self._in_flight = 0
        self._last_done = time.monotonic()
        self._parked: Any = None  # the park's handle while the workers are parked
        self._closed = False
        self.num_parks = 0  # how many times the workers were parked (tests, logs)
        self._thread = threading.Thread(target=self._run, name="tandem-idle-parking", daemon=True)
        self._thread.start()

    @property
    def parked(self) -> bool:
        with self._cond:
            return self._parked is not None

    def step_started(self) -> None:
        """Before a step is submitted: unpark the workers if they are parked. Raises what
        unparking raised (a worker died while parked): the step's failure."""
        with self._cond:
            self._in_flight += 1
            if self._parked is not None:
                handle, self._parked = self._parked, None
                self._unpark(handle, self._unpark_timeout_s)

    def step_done(self) -> None:
        """A step's result (or failure) is in: the idle clock starts again."""
        with self._cond:
            self._in_flight -= 1
            self._last_done = time.monotonic()
            self._cond.notify()

    def close(self, unpark: bool = True) -> None:
        """Stop parking. `unpark`: wake parked workers first (a compiled graph's teardown waits
        for its loops, which a parked worker is not in); a failed group's are killed instead."""
        with self._cond:
            self._closed = True
            handle, self._parked = self._parked, None
            self._cond.notify()
        self._thread.join()
        if handle is not None and unpark:
            try:
                self._unpark(handle, min(self._unpark_timeout_s, 30.0))
            except Exception:  # noqa: BLE001 - shutting down: the workers are killed next
                logger.debug("unparking the workers at shutdown failed", exc_info=True)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._parked is not None or self._in_flight:
                    self._cond.wait()
                    continue
                wait_s = self._last_done + self.after_s - time.monotonic()
                if wait_s > 0:
                    self._cond.wait(wait_s)
                    continue
                try:
                    self._parked = self._park()
                    self.num_parks += 1
                except Exception:  # noqa: BLE001 - the group is failing: its next step says why
                    logger.warning("parking the idle workers failed; they stay in their loops", exc_info=True)
                    return
