"""GroupHealer: a replica group that starts new workers when one of its workers dies.

A TP or PP group's workers are Ray actors in its replica's placement group. When one dies
(killed, out of memory, crashed), the executor kills the rest and the engine ends every
request in flight with an error. Serve would replace the whole replica: three missed health
checks, a new process importing Serve, torch and transformers, a new placement group, then
the workers. The healer does only the last part, in the replica that is already running:

    engine fails ──> healer thread: rebuild_engine() (new workers in the same bundles,
                     weights loaded again, KV cache sized) ──> AsyncEngine.replace_engine()

An idle group's workers are checked every `probe_interval_s` (a built-in no-op call
to each), so a worker that dies between requests is replaced before a request finds it, and so
is one that answers no probe for `silent_s` between steps (stopped, or hung outside a step; a
stall inside a step is the stall watchdog's, GroupServer.check_health).
While it rebuilds, the group reports itself unhealthy to the request router (its load is infinite,
so requests go to other groups) but passes Serve's health check. A rebuild that fails, takes
longer than `timeout_s`, or comes more than `max_rebuilds` times within `window_s` gives up:
the group then fails its health check and Serve replaces the replica, as it does for a group
whose replica process itself died.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.workers.engine.async_engine import AsyncEngine
    from tandem.workers.engine.group_engine import GroupEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealPolicy:
    max_rebuilds: int = 3  # rebuilds within window_s; beyond them Serve replaces the replica
    window_s: float = 600.0
    timeout_s: float = 120.0  # one rebuild, from the failure to serving
    # How often an idle group's workers are checked: a step finds a dead worker at once,
    # but a group with nothing to do would find it only when the next request fails.
    probe_interval_s: float = 2.0
    silent_s: float = 30.0  # a worker that answers no probe this long between steps is given up

    def __post_init__(self) -> None:
        if self.max_rebuilds < 0 or min(self.window_s, self.timeout_s, self.probe_interval_s, self.silent_s) <= 0:
            raise ValueError(f"heal policy: max_rebuilds must be >= 0, window_s, timeout_s, probe_interval_s and "
                             f"silent_s > 0, got {self}")


class GroupHealer:
    """Rebuilds `engine`'s group on a thread of its own each time it fails, within `policy`."""

    def __init__(self, engine: AsyncEngine, rebuild: Callable[[GroupEngine], GroupEngine],
                 on_swapped: Callable[[GroupEngine], None] | None = None, policy: HealPolicy = HealPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`rebuild(failed)`: a new engine, ready to serve; `on_swapped(new)` runs on the engine
        thread once the new engine has taken the failed one's place."""
        self.engine = engine
        self.policy = policy
        self._rebuild = rebuild
        self._on_swapped = on_swapped
        self._clock = clock
        self._failed: GroupEngine | None = None
        self._failed_at: float | None = None
        self._rebuilds: deque[float] = deque()  # when each rebuild started, within the window
        self.num_rebuilds = 0
        self.gave_up: str | None = None  # why the group is left to Serve
        self._silent_since: dict[str, float] = {}  # rank -> when it first missed a probe, between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-group-healer", daemon=True)
        self._thread.start()
        engine.add_failure_listener(self._engine_failed)

    @property
    def healing(self) -> bool:
        return self._failed_at is not None and self.gave_up is None

    def check(self) -> None:
        """Raise when the group is failed for good (Serve's health check then replaces it)."""
        if self.gave_up is not None:
            raise RuntimeError(self.gave_up)
        if self._failed_at is not None and self._clock() - self._failed_at > self.policy.timeout_s:
            self.gave_up = f"the group was not rebuilt within {self.policy.timeout_s:g} s of failing"
            raise RuntimeError(self.gave_up)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _probe(self) -> None:
        """Fail the engine when a worker's process is gone, or when it has answered no probe for
        `silent_s` while no step ran (it then heals as after a step)."""
        if self.engine.dead_error is not None or self._failed is not None:
            self._silent_since.clear()
            return
        try:
            probe = self.engine.probe_workers()
        except Exception:  # noqa: BLE001 - the next probe, or the next step, tells
            logger.debug("probing the group's workers failed", exc_info=True)
            return
        if probe.dead:
            self._silent_since.clear()
            self.engine.fail_engine(f"worker {', '.join(probe.dead)} died (found between steps)")
            return
        now = self._clock()
        if self.engine.step_running_for() > 0:  # a step's stall is the stall watchdog's to find
            self._silent_since.clear()
            return
        self._silent_since = {rank: self._silent_since.get(rank, now) for rank in probe.silent}
        stuck = sorted(rank for rank, since in self._silent_since.items() if now - since >= self.policy.silent_s)
        if stuck:
            self._silent_since.clear()
            self.engine.fail_engine(f"worker {', '.join(stuck)} answered no probe for {self.policy.silent_s:g} s "
                                    f"between steps (stopped or hung)")

    def _engine_failed(self, engine: GroupEngine) -> None:
        """Engine thread: hand the failed engine to the healer's thread."""
        self._failed, self._failed_at = engine, self._clock()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wake.wait(self.policy.probe_interval_s):
                self._probe()
                continue
            self._wake.clear()
            failed = self._failed
            if failed is None or self._stop.is_set() or self.gave_up is not None:
                continue
            now = self._clock()
            while self._rebuilds and now - self._rebuilds[0] > self.policy.window_s:
                self._rebuilds.popleft()
            if len(self._rebuilds) >= self.policy.max_rebuilds:
                self.gave_up = (f"the group failed ({failed.dead_error}) after {len(self._rebuilds)} rebuilds within "
                                f"{self.policy.window_s:g} s")
                logger.error("%s: leaving it to Serve to replace the replica", self.gave_up)
                continue
            self._rebuilds.append(now)
            logger.warning("replica group failed (%s): starting new workers", failed.dead_error)
            try:
                engine = self._rebuild(failed)
            except Exception as exc:  # noqa: BLE001 - Serve replaces the replica instead
                self.gave_up = f"the group failed ({failed.dead_error}) and could not be rebuilt: {exc}"
                logger.exception("rebuilding the replica group failed")
                continue
            if self._stop.is_set() or self.gave_up is not None:  # stopped or timed out meanwhile
                engine.shutdown()
                continue
            self._failed = self._failed_at = None  # before the swap: the new engine may fail too
            self.engine.replace_engine(engine, self._on_swapped)
            self.num_rebuilds += 1
            logger.warning("replica group rebuilt in %.1f s (%d KV blocks)", self._clock() - now,
                           engine.num_kv_blocks)
