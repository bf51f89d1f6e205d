"""What the test cluster's replica groups are, where they run and what they hold: a driver of
its own, in its own process, so the test process never joins the cluster (nor takes on its
token). It stays connected (to the head: Ray connects a driver to the head node of its
host first) and answers one JSON line per request line on stdin:

    python -m tests.deploy.cluster_probe GCS_ADDRESS DASHBOARD_URL

    {"num_groups": N, "timeout_s": T}  waits (up to T) until the tandem application has exactly
        N running groups, each idle with every KV block free; replies {"groups": {group_id:
        {"node_id", "on_head", "bundles_on_head" (engine, then each worker),
        "num_requests_total", "kv_blocks_free", "kv_blocks_total", "num_running"}}} (or the
        last state seen, with "timed_out": true), and "why": the nodes, their free resources
        and Serve's status of the group deployment.
    {"group": ID}  that group's figures now, no waiting ("error" says why there are none).
    {"replicas": DEPLOYMENT}  the tandem application's status and each live replica of DEPLOYMENT:
        {"status", "replicas": [{"node_resources", "required_resources"}]}, no waiting.

Each reply line starts with REPLY_PREFIX (Ray may write to stdout too). One driver serves
the whole test module: a Ray driver's start costs seconds of CPU, and tens of seconds on a
machine busy with the cluster's streams, which the streams under test may not outlast.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import Any

APP = "tandem"
HEAD_RESOURCE = "tandem_head"
REPLY_PREFIX = "probe: "
FIGURES = ("num_requests_total", "kv_blocks_free", "kv_blocks_total", "num_running", "error")


@functools.cache  # one handle, whose router keeps up with the groups: made once the application exists
def _group_handle() -> Any:
    from ray import serve

    return serve.get_deployment_handle("GroupServer", app_name=APP)


def _stats(group_id: str) -> dict[str, Any]:
    from tandem.workers.serving.messages import StatsRequest

    """One group's figures; "error" when it could not answer, or another group did (the
    router sends a call for a group it does not know to any group)."""
    try:
        stats = _group_handle().stats.remote(StatsRequest(target_group=group_id)).result(timeout_s=20)
    except Exception as exc:  # noqa: BLE001 - a group still starting, or just gone
        return {"error": f"{type(exc).__name__}: {exc}"}
    if stats.group_id != group_id:
        return {"error": f"answered by group {stats.group_id}"}
    return {"num_requests_total": stats.routing.num_requests_total, "kv_blocks_free": stats.kv_blocks_free,
            "kv_blocks_total": stats.kv_blocks_total, "num_running": stats.routing.num_running, "error": None}


def groups(dashboard: str) -> dict[str, dict[str, Any]]:
    import ray
    from ray import serve
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    on_head = {n["NodeID"]: n["Resources"].get(HEAD_RESOURCE, 0) > 0 for n in ray.nodes() if n["Alive"]}
    status = serve.status().applications.get(APP)
    if status is None or "GroupServer" not in status.deployments:
        return {}
    states = {str(getattr(k, "value", k)): v for k, v in status.deployments["GroupServer"].replica_states.items()}
    actors = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000)
    replicas = {a.name.rsplit("#", 1)[1]: a.node_id for a in actors
                if a.class_name == f"ServeReplica:{APP}:GroupServer" and a.name}
    # Serve names a replica's placement group after the replica.
    bundles = {}
    for pg in placement_group_table().values():
        if pg["state"] == "CREATED" and pg["name"].startswith(f"SERVE_REPLICA::{APP}#GroupServer#"):
            nodes = [node for _, node in sorted(pg["bundles_to_node_id"].items())]
            bundles[pg["name"].rsplit("#", 1)[1]] = [on_head.get(node, False) for node in nodes]
    out = {}
    for group_id, node_id in replicas.items():
        stats = _stats(group_id)
        out[group_id] = {"node_id": node_id, "on_head": on_head.get(node_id, False),
                         "bundles_on_head": bundles.get(group_id), **{k: stats.get(k) for k in FIGURES}}
    if states.get("RUNNING", 0) != len(out):
        return {}  # Serve and the actor table disagree for a moment (a group starting or ending)
    return out


def replicas(dashboard: str, deployment: str) -> dict[str, Any]:
    """Where each live replica of `deployment` runs (its node's resources) and what it reserved."""
    import ray
    from ray import serve
    from ray.util.state import list_actors

    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    # A test may have shut Serve down and started it again since this driver last asked: its
    # cached handle then names a dead controller. Forget it, so the running one is looked up.
    from ray.serve import context

    context._set_global_client(None)
    status = serve.status().applications.get(APP)
    actors = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
    return {"status": None if status is None else str(getattr(status.status, "value", status.status)),
            "replicas": [{"node_resources": nodes.get(a.node_id), "required_resources": a.required_resources}
                         for a in actors if a.class_name == f"ServeReplica:{APP}:{deployment}"]}


def _settled(found: dict[str, dict[str, Any]], num_groups: int) -> bool:
    return len(found) == num_groups and all(
        g["error"] is None and g["num_running"] == 0 and g["kv_blocks_free"] == g["kv_blocks_total"]
        for g in found.values())


def settle(dashboard: str, num_groups: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = groups(dashboard)
        if _settled(found, num_groups) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return {"groups": found, "timed_out": not _settled(found, num_groups), "why": _diagnosis()}


def main(gcs: str, dashboard: str) -> None:
    import ray

    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
    for line in sys.stdin:  # until the test closes stdin
        ask = json.loads(line)
        if "group" in ask:
            reply = _stats(ask["group"])
        elif "replicas" in ask:
            reply = replicas(dashboard, ask["replicas"])
        else:
            reply = settle(dashboard, ask["num_groups"], ask["timeout_s"])
        print(REPLY_PREFIX + json.dumps(reply), flush=True)
    ray.shutdown()


def _diagnosis() -> dict[str, Any]:
    """What a timed-out probe saw: the nodes alive and their free resources, and Serve's word on
    the group deployment (a replica waiting for resources says so there)."""
    import ray
    from ray import serve

    status = serve.status().applications.get(APP)
    deployment = status.deployments.get("GroupServer") if status is not None else None
    return {
        "nodes": [{"node_id": n["NodeID"][:8], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()],
        "available": ray.available_resources(),
        "deployment": None if deployment is None else {
            "status": str(deployment.status), "message": deployment.message,
            "replica_states": {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}},
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
