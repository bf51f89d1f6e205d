"""The cluster-wide KV block allocator: one named Ray actor per Serve application.

It knows every group's KV capacity (device leases), the host-memory budget per
node and who holds it (host leases, for offloaded blocks), every group's usage,
and the global prefix directory. Groups talk to it only asynchronously and in
batches (see allocator_client.py); nothing on the per-token path waits on it.

If the actor dies Ray restarts it empty. A group then learns from the next
`publish` answer (False = "who are you?") that it must register again, sending
the hashes it holds, so the directory heals without anyone stopping.

The actor is detached (see docs/architecture.md), so nothing ends it with the application
but `tandem serve`'s teardown. An application stopped some other way (`serve shutdown` of
a config-file app) would leave it behind for good; instead, an allocator without groups for
`idle_exit_s` (10 minutes) ends itself. A group of a later application creates it anew.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.prefix_directory import GroupId, PrefixDirectory


@dataclass
class GroupRecord:
    group_id: GroupId
    model_id: str
    block_size: int
    device_blocks: int  # the device lease
    node_id: str
    host_bytes: int = 0  # the host lease
    kv_layout: str = ""  # groups with equal layouts can copy KV blocks between them
    usage: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0


class KVAllocatorState:
    """All the allocator's logic, plain Python (the actor is a thin wrapper)."""

    def __init__(self, host_bytes_per_node: int | None = None, group_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, idle_exit_s: float | None = None) -> None:
        self.host_bytes_per_node = host_bytes_per_node  # None: no node budget, grant every ask
        # A group publishes (at least its usage) every ~0.1 s; one silent this long died
        # without unregistering (its process was killed): its leases and blocks are dropped.
        self.group_timeout_s = group_timeout_s
        self._clock = clock
        self.groups: dict[GroupId, GroupRecord] = {}
        self.directory = PrefixDirectory()
        self.started_at = time.time()
        self.idle_exit_s = idle_exit_s  # None: never idle out (plain use, tests)
        self._last_active = clock()  # a group's last register / publish / unregister

    # ---- membership and leases ------------------------------------------------------------------
    def register(self, group_id: GroupId, model_id: str, block_size: int, device_blocks: int, node_id: str,
                 cached_hashes: list[int] | None = None, *, host_bytes: int = 0,
                 kv_layout: str = "") -> dict[str, Any]:
        """(Re-)register a group: its device lease, the host bytes it holds or asks for, and
        the prefix blocks it already holds. Returns the host grant (a re-registering group
        gets back what it held unless the node's budget has been given to others since)."""
        if device_blocks < 1 or block_size < 1:
            raise ValueError(f"device_blocks and block_size must be >= 1, got {device_blocks}, {block_size}")
        self.directory.remove_group(group_id)
        self._last_active = self._clock()
        self.groups[group_id] = GroupRecord(group_id, model_id, block_size, device_blocks, node_id,
                                            kv_layout=kv_layout, last_seen=self._last_active)
        self.directory.add_group(group_id)
        self.directory.apply(group_id, [("stored", h) for h in cached_hashes or ()])
        granted = self.lease_host(group_id, host_bytes) if host_bytes else 0
        return {"started_at": self.started_at, "host_bytes": granted}

    def unregister(self, group_id: GroupId) -> None:
        self._last_active = self._clock()
        self.groups.pop(group_id, None)
        self.directory.remove_group(group_id)

    def lease_host(self, group_id: GroupId, num_bytes: int) -> int:
        """Grant up to num_bytes of its node's host budget to a group; returns the grant."""
        self.expire_silent_groups()  # a dead group's lease goes back to its node
        record = self.groups[group_id]
        if self.host_bytes_per_node is None:
            record.host_bytes = max(0, num_bytes)
            return record.host_bytes
        held = sum(g.host_bytes for g in self.groups.values() if g.node_id == record.node_id and g is not record)
        record.host_bytes = max(0, min(num_bytes, self.host_bytes_per_node - held))
        return record.host_bytes

    # ---- events and figures ---------------------------------------------------------------------
    def publish(self, group_id: GroupId, events: list[tuple[str, int]], usage: dict[str, Any]) -> bool:
        """Apply a batch of block events and the group's usage. False: unknown group, re-register."""
        record = self.groups.get(group_id)
        if record is None:
            return False
        self.directory.apply(group_id, events)
        record.usage = dict(usage)
        record.last_seen = self._last_active = self._clock()
        return True

    def expire_silent_groups(self) -> list[GroupId]:
        """Drop groups not heard from for `group_timeout_s`; returns their ids."""
        horizon = self._clock() - self.group_timeout_s
        silent = [g for g, r in self.groups.items() if r.last_seen < horizon]
        for group_id in silent:
            self.unregister(group_id)
        return silent

    def match(self, block_hashes: list[int], model_id: str | None = None) -> dict[GroupId, int]:
        self.expire_silent_groups()
        counts = self.directory.match(block_hashes)
        if model_id is not None:
            counts = {g: n for g, n in counts.items() if self.groups[g].model_id == model_id}
        return counts

    def holders(self, block_hashes: list[int], kv_layout: str) -> dict[GroupId, int]:
        """Like `match`, only groups whose KV layout is `kv_layout` (they can send blocks)."""
        self.expire_silent_groups()
        return {g: n for g, n in self.directory.match(block_hashes).items()
                if self.groups[g].kv_layout == kv_layout}

    def usage(self) -> dict[GroupId, dict[str, Any]]:
        self.expire_silent_groups()
        return {g: {**r.usage, "device_blocks": r.device_blocks, "host_bytes": r.host_bytes,
                    "directory_blocks": self.directory.num_blocks(g), "node_id": r.node_id}
                for g, r in self.groups.items()}

    def capacity(self) -> dict[str, int]:
        self.expire_silent_groups()
        nodes = {r.node_id for r in self.groups.values()}
        return {
            "device_blocks": sum(r.device_blocks for r in self.groups.values()),
            "host_bytes_total": (-1 if self.host_bytes_per_node is None  # -1: no budget set
                                 else self.host_bytes_per_node * len(nodes)),
            "host_bytes_leased": sum(r.host_bytes for r in self.groups.values()),
            "num_groups": len(self.groups),
        }

    def ping(self) -> float:
        return self.started_at

    def is_idle(self) -> bool:
        """The application that used this allocator is gone: no group has registered, published
        or left for `idle_exit_s`, and a group still registered has been silent long enough to
        count as dead (`group_timeout_s`) before that. A registered group is never idled out by
        a late publish (a loaded host can delay one by seconds); only its silence past the
        group timeout starts the idle clock. Reads a float and a dict's size, so the actor's
        timer thread may ask it while a call runs."""
        if self.idle_exit_s is None:
            return False
        silent_s = self._clock() - self._last_active
        if self.groups:
            silent_s -= self.group_timeout_s
        return silent_s >= self.idle_exit_s


# An allocator with no group this long ends itself (its application was stopped without
# `tandem serve`'s teardown). Longer than any restart of an application's groups.
IDLE_EXIT_S = 600.0


class KVAllocatorActor(KVAllocatorState):
    """The actor: the state, plus a timer thread that ends it once it is idle.

    `ray.kill(no_restart=True)` from that thread, not `exit_actor()` from a call the actor
    sends itself: such an exit waits for the calls the actor has in flight to itself, which
    never run. Dying between a group's calls is safe by design (the group re-registers
    with whichever allocator answers next, see allocator_client.py).
    """

    def __init__(self, host_bytes_per_node: int | None = None, idle_exit_s: float = IDLE_EXIT_S,
                 app_name: str = "") -> None:
        import ray
        from ray.util.metrics import Counter

        super().__init__(host_bytes_per_node, idle_exit_s=idle_exit_s)
        # The cluster-wide prefix cache, as routing asks it (Prometheus: workers/serving/group_metrics.py's names).
        self._queries = Counter("tandem_cluster_prefix_cache_queries", "Prompt blocks looked up in the cluster "
                                "prefix directory", tag_keys=("application",))
        self._hits = Counter("tandem_cluster_prefix_cache_hits", "Of those, leading blocks some group holds",
                             tag_keys=("application",))
        for counter in (self._queries, self._hits):
            counter.set_default_tags({"application": app_name})
            counter._record(0.0)  # the series exists from the start (inc refuses 0)
        me = ray.get_runtime_context().current_actor
        threading.Thread(target=self._end_when_idle, args=(me, min(60.0, idle_exit_s / 4)), daemon=True,
                         name="tandem-allocator-idle").start()

    def match(self, block_hashes: list[int], model_id: str | None = None) -> dict[GroupId, int]:
        counts = super().match(block_hashes, model_id)
        if block_hashes:
            self._queries.inc(len(block_hashes))
            best = max(counts.values(), default=0)
            if best:
                self._hits.inc(best)
        return counts

    def _end_when_idle(self, me: Any, period_s: float) -> None:
        import ray

        while not self.is_idle():
            time.sleep(period_s)
        ray.kill(me, no_restart=True)  # not restarted; the name is free for the next application


ALLOCATOR_NAMESPACE = "tandem"


def allocator_name(app_name: str) -> str:
    return f"tandem-kv-allocator-{app_name}"


def get_or_create_allocator(app_name: str, host_bytes_per_node: int | None = None,
                            namespace: str = ALLOCATOR_NAMESPACE, idle_exit_s: float = IDLE_EXIT_S) -> Any:
    """The application's allocator actor, created by whichever group asks first.

    Detached (it outlives the replica that created it) and restarted by Ray if it dies;
    the application's teardown (`kill_allocator`) kills it, and it ends itself after
    `idle_exit_s` without groups.

    Outside any placement group: a group's replica runs in one that captures its child
    actors, and an allocator placed there would die with that group's placement group and
    could never restart (its bundle gone), leaving every later group unregistered.
    """
    import ray

    actor_cls = ray.remote(KVAllocatorActor)
    return actor_cls.options(name=allocator_name(app_name), namespace=namespace, get_if_exists=True,
                             lifetime="detached", max_restarts=-1, max_task_retries=0,
                             num_cpus=0, scheduling_strategy="DEFAULT").remote(
        host_bytes_per_node, idle_exit_s, app_name)


class AllocatorRef:
    """The application's allocator for async callers (the router, a group's fetcher): looked
    up off the event loop, looked up again after a failed call (killed for good, or a stale
    handle), and at most every `retry_s` while it cannot be found."""

    def __init__(self, app_name: str, retry_s: float = 1.0, namespace: str = ALLOCATOR_NAMESPACE) -> None:
        self.app_name = app_name
        self.retry_s = retry_s
        self.namespace = namespace
        self._actor: Any = None
        self._next_lookup = 0.0

    async def call(self, method: str, *args: Any) -> Any:
        import asyncio

        import ray

        if self._actor is None:
            if time.monotonic() < self._next_lookup:
                raise LookupError(f"allocator {allocator_name(self.app_name)} not found yet")
            self._next_lookup = time.monotonic() + self.retry_s
            # get_actor asks the GCS (a blocking call): a thread, never the loop.
            self._actor = await asyncio.to_thread(ray.get_actor, allocator_name(self.app_name),
                                                  namespace=self.namespace)
        try:
            return await getattr(self._actor, method).remote(*args)
        except Exception:
            self._actor = None
            raise


def kill_allocator(app_name: str, namespace: str = ALLOCATOR_NAMESPACE) -> bool:
    """End the application's allocator for good (application teardown); False if none."""
    import ray

    try:
        actor = ray.get_actor(allocator_name(app_name), namespace=namespace)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
