"""What the test cluster's replica groups are, where they run and what they hold, as JSON.

    python -m tests.deploy.cluster_probe GCS_ADDRESS DASHBOARD_URL NUM_GROUPS TIMEOUT_S

Waits (up to TIMEOUT_S) until the tandem application has exactly NUM_GROUPS running groups,
each idle with every KV block free, then prints {"groups": {group_id: {"node_id",
"on_head", "bundles_on_head" (engine, then each worker), "num_requests_total",
"kv_blocks_free", "kv_blocks_total", "num_running"}}}
(or the last state seen, with "timed_out": true), and "why": the nodes, their free resources and
Serve's status of the group deployment. A driver of its own, in its own process,
so the test process never joins the cluster (nor takes on its token).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

APP = "tandem"
HEAD_RESOURCE = "tandem_head"


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
    handle = serve.get_deployment_handle("GroupServer", app_name=APP)
    out = {}
    for group_id, node_id in replicas.items():
        try:
            stats = handle.stats.remote({"target_group": group_id}).result(timeout_s=20)
        except Exception as exc:  # noqa: BLE001 - a group still starting, or just gone
            stats = {"error": f"{type(exc).__name__}: {exc}"}
        out[group_id] = {"node_id": node_id, "on_head": on_head.get(node_id, False),
                         "bundles_on_head": bundles.get(group_id),
                         **{k: stats.get(k) for k in ("num_requests_total", "kv_blocks_free", "kv_blocks_total",
                                                      "num_running", "error")}}
    if states.get("RUNNING", 0) != len(out):
        return {}  # Serve and the actor table disagree for a moment (a group starting or ending)
    return out


def _settled(found: dict[str, dict[str, Any]], num_groups: int) -> bool:
    return len(found) == num_groups and all(
        g["error"] is None and g["num_running"] == 0 and g["kv_blocks_free"] == g["kv_blocks_total"]
        for g in found.values())


def main(gcs: str, dashboard: str, num_groups: int, timeout_s: float) -> None:
    import ray

    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + timeout_s
    found: dict[str, dict[str, Any]] = {}
    while True:
        found = groups(dashboard)
        if _settled(found, num_groups) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    report = {"groups": found, "timed_out": not _settled(found, num_groups), "why": _diagnosis()}
    print(json.dumps(report), flush=True)
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
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
