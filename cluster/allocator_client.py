"""A group's link to the cluster allocator: batched, asynchronous, never in the way.

The engine thread calls `submit(events, usage)` after each step; that only appends
to a buffer. A background thread publishes the buffer every `interval_s`; with no events and
usage unchanged (an idle group) it publishes only every `heartbeat_s`, which keeps the group
known (the allocator forgets a group silent for its `group_timeout_s`, 10 s). When the
allocator answers "unknown group" (it restarted) or cannot be reached, the client
keeps retrying and re-registers with a full snapshot of the group's cached hashes,
which the engine thread supplies at its next submit (`wake_engine` makes an idle engine
submit). Serving never waits on any of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupIdentity:
    group_id: str
    model_id: str
    block_size: int
    device_blocks: int
    node_id: str
    host_bytes: int = 0  # the host-tier bytes the group holds (re-claimed on re-registration)
    kv_layout: str = ""

    def register(self, actor: Any, cached_hashes: list[int], host_bytes: int | None = None) -> Any:
        """Start `actor.register` for this group (an ObjectRef of its reply); `host_bytes`
        overrides the held bytes when asking for a first lease."""
        return actor.register.remote(self.group_id, self.model_id, self.block_size, self.device_blocks, self.node_id,
                                     cached_hashes, host_bytes=self.host_bytes if host_bytes is None else host_bytes,
                                     kv_layout=self.kv_layout)


class AllocatorClient:
    def __init__(self, get_actor: Callable[[], Any], identity: GroupIdentity, interval_s: float = 0.1,
                 call_timeout_s: float = 2.0, wake_engine: Callable[[], None] = lambda: None,
                 heartbeat_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._get_actor = get_actor
        self._wake_engine = wake_engine  # an idle engine must still hand over a snapshot
        self.identity = identity
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._published: tuple[float, dict[str, Any]] | None = None  # (when, the usage) of the last publish
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._events: list[tuple[str, int]] = []
        self._usage: dict[str, Any] = {}
        self._snapshot: list[int] | None = None
        self.want_snapshot = True  # the first contact registers with everything held
        self.reachable = False
        self.num_registrations = 0
        self._actor: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-allocator-client", daemon=True)
        self._thread.start()

    def submit(self, events: list[tuple[str, int]], usage: dict[str, Any],
               snapshot: Callable[[], list[int]]) -> None:
        """Engine thread: queue this step's events; hand over a snapshot if one was asked for."""
        with self._lock:
            if self.want_snapshot:
                # The snapshot replaces everything queued before it.
                self._snapshot, self._events = snapshot(), []
                self.want_snapshot = False
            else:
                self._events.extend(events)
            self._usage = usage

    def resync(self, device_blocks: int) -> None:
        """The group was rebuilt (new workers, an empty cache): register again with what the
        engine holds now, at its next submit."""
        self.identity = replace(self.identity, device_blocks=device_blocks)
        self._ask_snapshot()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            (self._actor or self._get_actor()).unregister.remote(self.identity.group_id)
        except Exception:  # best effort: the allocator may be gone already
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        """One interval's publish: what the engine queued, or a heartbeat when it is due."""
        import ray

        with self._lock:
            snapshot, events, usage = self._snapshot, self._events, self._usage
            self._snapshot, self._events = None, []
        if snapshot is None and not events:
            if not usage:
                return
            now, last = self._clock(), self._published
            if last is not None and last[1] == usage and now - last[0] < self.heartbeat_s:
                return  # idle: nothing new to say until the heartbeat
        try:
            actor = self._actor = self._actor or self._get_actor()
            if snapshot is not None:
                ray.get(self.identity.register(actor, snapshot), timeout=self.call_timeout_s)
                self.num_registrations += 1
            known = ray.get(actor.publish.remote(self.identity.group_id, events, usage),
                            timeout=self.call_timeout_s)
            self.reachable = True
            self._published = (self._clock(), usage)
            if not known:
                logger.info("allocator does not know group %s; registering again", self.identity.group_id)
                self._ask_snapshot()
        except Exception as exc:  # unreachable or restarting: keep serving, resync later
            if self.reachable:
                logger.warning("KV allocator unreachable (%s); routing falls back to load only", exc)
            self.reachable = False
            self._actor = None  # find it again (it may have been replaced)
            self._ask_snapshot()

    def _ask_snapshot(self) -> None:
        with self._lock:
            self.want_snapshot = True
        self._wake_engine()
