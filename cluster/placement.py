"""Where a replica group's workers go: one placement group, one bundle per worker.

    bundle index = first + pp_rank * tp + tp_rank      (first + the worker's global rank)

A pipeline stage's TP ranks talk on every layer, so they are packed on one node; stages
only pass hidden states once per micro-batch, so they may sit on different nodes. The
plan picks a node per stage up front (best fit, so small groups pack together) and pins
each bundle there with a node-id label selector. A layout the cluster cannot hold is
refused here with what was asked and what the cluster has, since Ray would leave such a
placement group pending forever. The GPUs no group uses are reported, for draft models.

An engine built inside a Serve replica that reserved its own placement group (bundle 0
for the replica, one per worker after it) uses that group's bundles instead
(`WorkerBundles.of_existing`); then the replica's deployment options decide the nodes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.local_ray import start_local_ray

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(ValueError):
    """The requested layout cannot be placed on this cluster."""


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    ip: str
    total: dict[str, float]
    available: dict[str, float]

    def free(self, resource: str) -> int:
        return int(self.available.get(resource, 0.0) + 1e-6)

    @property
    def short(self) -> str:
        return f"{self.node_id[:8]} ({self.ip})"


@dataclass(frozen=True)
class PlacementPlan:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    use_gpu: bool
    cpus_per_worker: float
    stage_nodes: tuple[str, ...]  # node id per pipeline stage
    spare_gpus: dict[str, int] = field(default_factory=dict)  # node id -> GPUs left for drafts

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def bundles(self) -> list[dict[str, float]]:
        bundle = {"GPU": 1.0} if self.use_gpu else {"CPU": float(self.cpus_per_worker)}
        return [dict(bundle) for _ in range(self.world_size)]

    @property
    def bundle_label_selector(self) -> list[dict[str, str]]:
        return [{NODE_ID_LABEL: self.stage_nodes[rank // self.tensor_parallel_size]}
                for rank in range(self.world_size)]

    def node_of(self, pp_rank: int) -> str:
        return self.stage_nodes[pp_rank]


def plan_placement(tp: int, pp: int, nodes: list[NodeResources], *, use_gpu: bool,
                   cpus_per_worker: float = 1.0) -> PlacementPlan:
    """Choose a node for each pipeline stage, or raise PlacementError saying why none fits."""
    resource = "GPU" if use_gpu else "CPU"
    per_worker = 1.0 if use_gpu else cpus_per_worker
    need = tp * per_worker  # per stage, on one node
    free = {n.node_id: n.available.get(resource, 0.0) for n in nodes}
    stage_nodes: list[str] = []
    for _ in range(pp):
        fits = [n for n in nodes if free[n.node_id] + 1e-6 >= need]
        if not fits:
            raise PlacementError(_unplaceable_message(tp, pp, nodes, resource, per_worker, len(stage_nodes)))
        best = min(fits, key=lambda n: free[n.node_id])  # best fit: pack stages where they just fit
        free[best.node_id] -= need
        stage_nodes.append(best.node_id)
    spare = {n.node_id: int(free[n.node_id] + 1e-6) if use_gpu else n.free("GPU") for n in nodes}
    return PlacementPlan(tp, pp, use_gpu, cpus_per_worker, tuple(stage_nodes),
                         {k: v for k, v in spare.items() if v > 0})


def _unplaceable_message(tp: int, pp: int, nodes: list[NodeResources], resource: str, per_worker: float,
                         num_placed: int) -> str:
    asked = (f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {pp} stage(s) of {tp} "
             f"worker(s), each stage on one node: {tp * per_worker:g} {resource} per node, "
             f"{tp * pp * per_worker:g} {resource} in all")
    has = ", ".join(f"{n.short}: {n.available.get(resource, 0.0):g} of {n.total.get(resource, 0.0):g} free"
                    for n in nodes) or "no alive nodes"
    total_free = sum(n.available.get(resource, 0.0) for n in nodes)
    where = f"only {num_placed} stage(s) fit" if num_placed else "no stage fits"
    return (f"cannot place the replica group: {asked}; the cluster has {resource} per node: {has} "
            f"({total_free:g} free in all); {where}")


# ---- the live cluster ------------------------------------------------------------------------------
def ensure_ray(address: str | None, min_cpus: int = 1) -> None:
    """Join the cluster at `address` (or the one already running here), else start a local one.

    A local instance gets at least `min_cpus` logical CPUs, so a laptop can hold a group of
    more workers than it has cores (they then share the cores, one thread each).
    """
    import ray

    if ray.is_initialized():
        return
    try:
        from ray._private.services import canonicalize_bootstrap_address

        existing = canonicalize_bootstrap_address(address)
    except Exception:  # pragma: no cover - private API moved: let ray.init decide
        existing = address
    if existing is None:
        start_local_ray(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False)
    else:
        ray.init(address=address, include_dashboard=False)


def cluster_nodes() -> list[NodeResources]:
    """Alive nodes with their total and currently available resources."""
    import ray

    try:
        from ray._private.state import state  # per-node availability; no public API without the dashboard

        available = state.available_resources_per_node()
    except Exception:  # pragma: no cover - older/newer Ray: fall back to totals
        available = {}
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        total = {k: float(v) for k, v in n.get("Resources", {}).items()}
        nodes.append(NodeResources(n["NodeID"], n.get("NodeManagerAddress", "?"), total,
                                   {k: float(v) for k, v in available.get(n["NodeID"], total).items()}))
    return nodes


def plan_on_cluster(tp: int, pp: int, *, use_gpu: bool, wait_s: float = 10.0) -> PlacementPlan:
    """Plan against the live cluster. A layout the idle cluster could not hold fails at once;
    one that only lacks free resources (say, a group just shut down is still releasing
    them) is retried for up to `wait_s` before failing."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = cluster_nodes()
        try:
            return plan_placement(tp, pp, nodes, use_gpu=use_gpu)
        except PlacementError as exc:
            idle = [NodeResources(n.node_id, n.ip, n.total, n.total) for n in nodes]
            plan_placement(tp, pp, idle, use_gpu=use_gpu)  # raises if it can never fit
            if time.monotonic() >= deadline:
                raise PlacementError(f"{exc} (an idle cluster could hold it: resources are in use)") from None
        time.sleep(0.2)


def spare_gpus() -> dict[str, int]:
    """Node id -> GPUs no placement group or actor holds right now (where draft models can go)."""
    return {n.node_id: n.free("GPU") for n in cluster_nodes() if n.free("GPU") > 0}


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def create_placement_group(plan: PlacementPlan, timeout_s: float = 60.0, name: str = ""):
    """Reserve the plan's bundles; raises PlacementError instead of waiting forever."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    start = time.perf_counter()
    pg = placement_group(plan.bundles, strategy="PACK", name=name,
                         bundle_label_selector=plan.bundle_label_selector)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(f"placement group for tensor_parallel_size={plan.tensor_parallel_size} x "
                             f"pipeline_parallel_size={plan.pipeline_parallel_size} was not ready after "
                             f"{timeout_s:g} s (bundles {plan.bundles} on nodes {plan.stage_nodes}); "
                             "the resources were probably taken after validation") from None
    logger.info("placement group ready in %.2f s: stages on nodes %s", time.perf_counter() - start,
                [n[:8] for n in plan.stage_nodes])
    return pg


@dataclass
class WorkerBundles:
    """Where the workers go: bundles first .. first + world - 1 of the placement group."""

    first: int
    use_gpu: bool
    cpus_per_worker: float
    nodes: list[str]  # node id per rank

    @staticmethod
    def of_existing(pg: Any, first: int) -> WorkerBundles:
        import ray

        spec = pg.bundle_specs[first]
        on_node = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        return WorkerBundles(first, spec.get("GPU", 0) > 0, spec.get("CPU", 1.0) if not spec.get("GPU") else 0,
                             [on_node[i] for i in range(first, pg.bundle_count)])


@dataclass(frozen=True)
class DevicePin:
    """A device an existing worker holds, for a process that shares it without reserving it
    again (a draft model with no spare GPU): the node, and the GPUs to make visible."""

    node_id: str
    gpu_ids: tuple[int, ...] = ()

    def actor_options(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict[str, Any] = dict(num_cpus=0, num_gpus=0,
                                       scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False))
        if self.gpu_ids:
            options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpu_ids))}}
        return options
