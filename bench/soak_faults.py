"""The faults `tandem bench soak --faults` injects while its load runs, and how long the
deployment takes to serve again after each. Only against a server on this machine (the
bench's own): they need the application's Ray cluster and its processes' ids.

    worker     one TP worker process of a group, SIGKILLed (the group's engine fails; the
               group starts new workers in place, workers/serving/group_healer.py)
    group      a whole replica group: its workers SIGKILLed and its Serve replica actor
               killed, at once
    allocator  the application's cluster KV allocator actor, killed (Ray restarts it; the
               groups register again)
    replica    one group's Serve replica actor, killed (its workers die with it)
    stall      one TP worker process of a group, SIGSTOPped: nothing fails. Between steps the
               group's healer finds a worker that does not answer its probe and rebuilds in
               place; in a step, the stall watchdog (`step_timeout_s`) fails its health check
               and Serve replaces it. The stopped process is killed once the soak has seen
               the recovery (Ray kills it with its group; this is only the clean-up)

Recovered: a probe request is served and the application is back to strength (every
group healthy and reporting, the one hit replaced, or for a worker or stall fault, serving on new
workers, the allocator reachable and leasing to every group). `recovery_s` is the time
from the kill to both.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandem.cluster.kv_allocator import ALLOCATOR_NAMESPACE, allocator_name

FAULT_KINDS = ("worker", "group", "allocator", "replica", "stall")
SERVE_NAMESPACE = "serve"

Holdings = Callable[[], Awaitable[dict[str, Any]]]  # the application's KV report (kv_report.py's shape)
Probe = Callable[[], Awaitable[bool]]  # one small request: served?


@dataclass
class FaultRecord:
    kind: str
    target: str
    injected_at: float  # seconds since the soak started
    serving_again_s: float | None = None  # a probe request served
    recovery_s: float | None = None  # served, and back to strength; None: not within the bound
    error: str = ""
    short_of_strength: str = ""  # not recovered: what the last look found missing ("" once recovered)


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_actor(name: str, namespace: str, no_restart: bool) -> None:
    import ray

    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=no_restart)


class FaultInjector:
    def __init__(self, app_name: str, holdings: Holdings, probe: Probe, *, num_groups: int,
                 recovery_timeout_s: float = 120.0, clock_zero: float | None = None) -> None:
        self.app_name = app_name
        self.holdings = holdings
        self.probe = probe
        self.num_groups = num_groups
        self.recovery_timeout_s = recovery_timeout_s
        self.zero = time.monotonic() if clock_zero is None else clock_zero

    async def inject(self, kind: str) -> FaultRecord:
        """Inject one fault and wait (bounded) until the deployment has recovered from it."""
        before = await self.holdings()
        groups = sorted(before["groups"].items())
        now = time.monotonic()
        record = FaultRecord(kind, "", now - self.zero)
        hit_group, old_workers, stopped = None, None, None
        try:
            if kind == "allocator":
                record.target = allocator_name(self.app_name)
                _kill_actor(record.target, ALLOCATOR_NAMESPACE, no_restart=False)
            else:
                with_workers = [(gid, g) for gid, g in groups if g["worker_pids"]]
                if not groups or (kind in ("worker", "stall") and not with_workers):
                    raise RuntimeError(f"no group to inject a {kind} fault into")
                hit_group, group = (with_workers or groups)[0]
                record.target = hit_group
                if kind == "worker":
                    old_workers = set(group["worker_pids"])
                    record.target += f" worker pid {group['worker_pids'][-1]}"
                    _kill_pids(group["worker_pids"][-1:])
                elif kind == "group":
                    _kill_pids(group["worker_pids"])
                    _kill_actor(group["actor_name"], SERVE_NAMESPACE, no_restart=True)
                elif kind == "replica":
                    _kill_actor(group["actor_name"], SERVE_NAMESPACE, no_restart=True)
                elif kind == "stall":
                    # Recovered either way: healed in place (the healer's probe finds a stopped
                    # worker as it finds a dead one) or replaced (the stall watchdog).
                    old_workers = set(group["worker_pids"])
                    stopped = group["worker_pids"][-1]
                    record.target += f" worker pid {stopped}"
                    os.kill(stopped, signal.SIGSTOP)
                else:
                    raise ValueError(f"fault: unknown kind {kind!r} (one of {', '.join(FAULT_KINDS)})")
        except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
            record.error = f"{type(exc).__name__}: {exc}"
            return record
        try:
            await self._wait_recovered(record, now, hit_group, old_workers)
        finally:
            if stopped is not None:
                _kill_pids([stopped])  # SIGKILL ends a stopped process too
        return record

    async def _wait_recovered(self, record: FaultRecord, killed_at: float, hit_group: str | None,
                              old_workers: set[int] | None) -> None:
        await asyncio.sleep(0.5)  # let the death be noticed before asking who is healthy
        record.short_of_strength = "not serving"
        while time.monotonic() - killed_at < self.recovery_timeout_s:
            if record.serving_again_s is None and await self.probe():
                record.serving_again_s = time.monotonic() - killed_at
            if record.serving_again_s is not None:
                record.short_of_strength = "; ".join(self.short_of_strength(await self.holdings(), hit_group,
                                                                            old_workers))
                if not record.short_of_strength:
                    record.recovery_s = time.monotonic() - killed_at
                    return
            await asyncio.sleep(0.5)

    def short_of_strength(self, report: dict[str, Any], hit_group: str | None = None,
                          old_workers: set[int] | None = None) -> list[str]:
        """What keeps the application from full strength (none: every group healthy and
        reporting, the hit one replaced, or with `old_workers` (the hit group's worker pids
        before a worker fault) serving on none of them, the allocator leasing to each)."""
        groups = report["groups"]
        allocator = report["allocator"]
        missing = []
        if len(groups) != self.num_groups:
            missing.append(f"{len(groups)} of {self.num_groups} groups")
        if report["unreachable_groups"]:
            missing.append(f"{report['unreachable_groups']} unreachable")
        missing += [f"group {gid} unhealthy" for gid, g in sorted(groups.items()) if not g["healthy"]]
        if hit_group in groups:
            pids = set(groups[hit_group].get("worker_pids", ()))
            if old_workers is None:
                missing.append(f"group {hit_group} (the one hit) still listed")
            elif not pids or pids & old_workers:
                missing.append(f"group {hit_group} (the one hit) still without new workers")
        if allocator.get("present"):
            missing += [f"group {gid} holds no allocator lease" for gid in sorted(set(groups) - set(allocator.get(
                "leases", {})))]
        return missing
