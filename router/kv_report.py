"""KV blocks held right now, over one application: every group's device and host tier, and
the cluster allocator's leases. Once a load has drained, every figure it sums must be 0.

    device_blocks_held   blocks some request references (total - free; cached prefix
                         blocks nobody references count as free: they are a cache)
    host_blocks_held     host-tier slots pinned for a pending load (the tier's cached
                         blocks are a cache too, reported as host_blocks_cached)
    stale_lease_blocks   device blocks the allocator still leases to groups that no
                         longer run (a killed group's lease lapses after its timeout)

Read by the ingress's `GET /admin/kv` (under the API key) and, through `RouterHooks`, by
`tandem bench soak` in the process that started the server. Blocking calls: run it on a
thread, never on an event loop.
"""

from __future__ import annotations

import logging
from typing import Any

from tandem.cluster.kv_allocator import ALLOCATOR_NAMESPACE, allocator_name
from tandem.workers.serving.messages import GROUP_STATS_KEY, GroupStats

logger = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # where Serve names its replica actors "SERVE_REPLICA::app#deployment#id"
GROUP_DEPLOYMENT = "GroupServer"


def group_replicas(app_name: str, deployment: str = GROUP_DEPLOYMENT) -> dict[str, str]:
    """{group id: its replica actor's name (namespace "serve")} of the application's live groups."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    return {entry["name"][len(prefix):]: entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == SERVE_NAMESPACE and entry["name"].startswith(prefix)}


def kv_holdings(app_name: str, deployment: str = GROUP_DEPLOYMENT, timeout_s: float = 5.0) -> dict[str, Any]:
    """Every group's KV figures and the allocator's leases, with the sums named above.

    Each group is read from its replica actor (`record_routing_stats`, which carries its whole
    GroupStats), not through a DeploymentHandle: a handle's call waits behind the group's
    generate calls for one of its `max_ongoing_requests` slots, so a saturated group would not
    report, and it goes only where the caller's router knows the replica (a router with a stale
    replica set sent every call to one group, and the others went unreported for minutes)."""
    import ray

    replicas = group_replicas(app_name, deployment)
    calls: dict[str, Any] = {}
    unreachable = []
    for gid, actor_name in replicas.items():
        try:
            calls[gid] = ray.get_actor(actor_name, namespace=SERVE_NAMESPACE).record_routing_stats.remote()
        except ValueError:  # gone since it was listed
            unreachable.append(gid)
    ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s) if calls else ([], [])
    ready = set(ready)
    groups: dict[str, dict[str, Any]] = {}
    for gid, call in calls.items():
        try:
            if call not in ready:
                raise TimeoutError(f"no answer in {timeout_s} s")
            stats = GroupStats.from_dict(ray.get(call)[GROUP_STATS_KEY])
        except Exception as exc:  # noqa: BLE001 - a group dying now: say so, never fail the report
            logger.info("group %s did not report its KV (%s)", gid, exc)
            unreachable.append(gid)
            continue
        groups[gid] = _group_figures(stats, replicas[gid])
    allocator = _allocator_leases(app_name, set(replicas), timeout_s)
    return {
        "groups": groups, "unreachable_groups": sorted(unreachable), "allocator": allocator,
        "device_blocks_held": sum(g["device_blocks_held"] for g in groups.values()),
        "host_blocks_held": sum(g["host_blocks_held"] for g in groups.values()),
        "host_blocks_cached": sum(g["host_blocks_cached"] for g in groups.values()),
        "stale_lease_blocks": allocator.get("stale_lease_blocks", 0),
        "requests_in_flight": sum(g["num_running"] + g["num_waiting"] for g in groups.values()),
    }


def _group_figures(stats: GroupStats, actor_name: str) -> dict[str, Any]:
    return {
        "actor_name": actor_name, "healthy": stats.routing.is_healthy, "worker_pids": list(stats.worker_pids),
        "num_rebuilds": stats.num_rebuilds, "num_running": stats.routing.num_running,
        "num_waiting": stats.routing.num_waiting, "device_blocks_total": stats.kv_blocks_total,
        "device_blocks_held": stats.kv_blocks_total - stats.kv_blocks_free,
        "host_blocks_total": stats.host_kv_blocks_total, "host_blocks_held": stats.host_kv_blocks_pinned,
        "host_blocks_cached": stats.host_kv_blocks_used, "num_preemptions": stats.num_preemptions,
    }


def _allocator_leases(app_name: str, live_groups: set[str], timeout_s: float) -> dict[str, Any]:
    """The allocator's leases ({} of them when prefix caching, and so the allocator, is off)."""
    import ray

    try:
        actor = ray.get_actor(allocator_name(app_name), namespace=ALLOCATOR_NAMESPACE)
        usage = ray.get(actor.usage.remote(), timeout=timeout_s)
    except ValueError:  # no allocator: none was ever made, or it was killed for good
        return {"reachable": False, "present": False, "leases": {}, "stale_leases": [], "stale_lease_blocks": 0}
    except Exception as exc:  # noqa: BLE001 - restarting (killed): its leases are being rebuilt
        return {"reachable": False, "present": True, "error": type(exc).__name__, "leases": {},
                "stale_leases": [], "stale_lease_blocks": 0}
    leases = {gid: {"device_blocks": int(u.get("device_blocks", 0)), "host_bytes": int(u.get("host_bytes", 0))}
              for gid, u in usage.items()}
    stale = sorted(gid for gid in leases if gid not in live_groups)
    return {"reachable": True, "present": True, "leases": leases, "stale_leases": stale,
            "stale_lease_blocks": sum(leases[gid]["device_blocks"] for gid in stale),
            "stale_lease_host_bytes": sum(leases[gid]["host_bytes"] for gid in stale)}
