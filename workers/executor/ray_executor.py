"""RayExecutor: one replica group's `tp x pp` Worker actors, driven one step at a time.

    engine ──step message──> [compiled graph: shared-memory channel to every worker]
           <──RunnerOutput── TP rank 0 of the last stage (the others send None)

Set-up: validate and reserve a placement group (cluster/placement.py), start one actor
per bundle, rendezvous torch.distributed at rank 0's node on a port chosen there at run
time, load shards, size the KV cache to what fits on every worker, then run one empty
step through the compiled graph (see __init__).

Each step reaches all workers as one message through a Ray compiled graph (shared-memory
channels; workers/executor/compiled_graph.py): an empty step costs a third of what plain
actor calls cost (figures in bench/RESULTS.md; `measure_control_overhead`). Its output is
read by polling, which holds one of the host's cores while a step runs: GPU groups use it,
CPU groups use plain actor calls (`compiled_graph` decides). Either way several steps may be
in flight, and each worker runs them in order. After `park_workers_after_s` without a step
the workers are parked off the CPU (workers/executor/parking.py), and the next step wakes
them. A worker that raises or dies fails the step: the executor kills the whole group at
once (peers blocked in a collective would otherwise wait for it) and raises, naming the
worker (workers/executor/worker_failure.py), so the engine ends its requests with finish
reason "error". A failed executor is spent; `shutdown()` and a new executor rebuild the
group in the same process.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from tandem.cluster.placement import (
    DevicePin,
    PlacementPlan,
    WorkerBundles,
    cluster_has_gpus,
    create_placement_group,
    ensure_ray,
    plan_on_cluster,
)
from tandem.workers.config import EngineConfig
from tandem.workers.core.scheduler_output import Park, PendingOutput, RunnerOutput, SchedulerOutput
from tandem.workers.executor.abstract import WorkerProbe
from tandem.workers.executor.compiled_graph import compile_step_graph, quiet_teardown
from tandem.workers.executor.parking import IdleParking
from tandem.workers.executor.worker_failure import describe_failure, rank_name
from tandem.workers.model.hf_config import HFModelConfig

logger = logging.getLogger(__name__)


class GroupFailedError(RuntimeError):
    """A worker of the group died or raised; the group must be rebuilt."""


class RayExecutor:
    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str, *,
                 use_compiled_graph: bool | None = None, step_timeout_s: float = 600.0,
                 placement_timeout_s: float = 60.0, pins: list[DevicePin] | None = None) -> None:
        """`pins`: put rank i on pins[i]'s node and devices without reserving them (a draft
        model sharing a group's devices); by default the workers get a placement group."""
        import ray

        par = config.parallel
        ensure_ray(par.address, par.world_size)
        self.tp, self.pp = par.tensor_parallel_size, par.pipeline_parallel_size
        self.step_timeout_s = step_timeout_s
        self.plan: PlacementPlan | None = None  # None when the workers go to an enclosing group
        self.workers: list[Any] = []
        self.dead_error: str | None = None
        self._dag = None
        self._parking: IdleParking | None = None
        self.placement_group = None
        self._owns_placement_group = False
        self.worker_info: list[dict[str, Any]] = []
        self.config = config
        self.pins = pins
        try:
            self.bundles = self._reserve(config, placement_timeout_s)
            self.device_type = "cuda" if self.bundles.use_gpu else "cpu"
            if use_compiled_graph is None:
                use_compiled_graph = par.compiled_graph if par.compiled_graph is not None else \
                    self.device_type == "cuda"
            self._start_workers(config, hf_config, model_dir)
            self.num_kv_blocks = self._init_workers()
            self.worker_info = ray.get([w.describe.remote() for w in self.workers])
            if use_compiled_graph:
                self._dag = compile_step_graph(self.workers, self.step_timeout_s)
                # One empty step through the graph: each channel is set up at its first use, and
                # a graph torn down (a worker died) before any step makes Ray abort this process
                # (its reader registration fails a check: the channel was never written).
                self._broadcast(SchedulerOutput(step_id=-1))
                if par.park_workers_after_s is not None:
                    self._parking = IdleParking(par.park_workers_after_s, self._park, self._unpark,
                                                unpark_timeout_s=step_timeout_s)
        except BaseException:
            self._teardown()
            raise

    # ---- set-up ------------------------------------------------------------------------------------
    def _reserve(self, config: EngineConfig, timeout_s: float) -> WorkerBundles:
        """The bundles the workers go to: the enclosing placement group's (a Serve replica
        that reserved one bundle for itself plus one per worker), else a new one planned here."""
        from ray.util import get_current_placement_group

        world = self.tp * self.pp
        if self.pins is not None:
            if len(self.pins) != world:
                raise ValueError(f"{len(self.pins)} device pins for {world} workers")
            return WorkerBundles(0, any(p.gpu_ids for p in self.pins), 0.0, [p.node_id for p in self.pins])
        current = get_current_placement_group()
        if current is not None and current.bundle_count == world + 1:
            self.placement_group = current  # not ours: whoever made it removes it
            bundles = WorkerBundles.of_existing(current, first=1)
            if config.model.device == "cuda" and not bundles.use_gpu:
                raise ValueError("device: cuda was asked for but the placement group's worker bundles have no GPU")
            split = [s for s in range(self.pp) if len(set(bundles.nodes[s * self.tp:(s + 1) * self.tp])) > 1]
            if split:
                logger.warning("pipeline stage(s) %s have TP ranks on several nodes: every layer's "
                               "all-reduce crosses the network", split)
            return bundles
        use_gpu = config.model.device != "cpu" and cluster_has_gpus()
        if config.model.device == "cuda" and not use_gpu:
            raise ValueError("device: cuda was asked for but the Ray cluster has no GPUs")
        self.plan = plan_on_cluster(self.tp, self.pp, use_gpu=use_gpu)
        self.placement_group = create_placement_group(self.plan, timeout_s)
        self._owns_placement_group = True
        return WorkerBundles(0, use_gpu, self.plan.cpus_per_worker,
                             [self.plan.node_of(rank // self.tp) for rank in range(world)])

    def _start_workers(self, config: EngineConfig, hf_config: HFModelConfig, model_dir: str) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tandem.workers.executor.worker import Worker

        bundles = self.bundles
        actor_cls = ray.remote(Worker)
        for rank, node in enumerate(bundles.nodes):
            if self.pins is not None:
                options = self.pins[rank].actor_options()
            else:
                options = dict(num_cpus=0 if bundles.use_gpu else bundles.cpus_per_worker,
                               num_gpus=1 if bundles.use_gpu else 0,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   self.placement_group, placement_group_bundle_index=bundles.first + rank))
            self.workers.append(actor_cls.options(**options).remote(
                config, hf_config, model_dir, rank, bundles.nodes.count(node)))

    def _init_workers(self) -> int:
        import ray

        info = ray.get(self.workers[0].describe.remote())
        port = ray.get(self.workers[0].free_port.remote())
        host = info["ip"]
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        ray.get([w.init_distributed.remote(init_method) for w in self.workers])
        fits = ray.get([w.load_model.remote() for w in self.workers])
        num_blocks = min(fits)
        if num_blocks < 1:
            raise ValueError("kv_cache_memory: too small for one KV block on some worker")
        ray.get([w.init_kv_cache.remote(num_blocks) for w in self.workers])
        logger.info("replica group up: tp=%d pp=%d, %d KV blocks per worker", self.tp, self.pp, num_blocks)
        return num_blocks

    @property
    def output_rank(self) -> int:
        return (self.pp - 1) * self.tp  # TP rank 0 of the last stage

    # ---- steps -------------------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        if self.dead_error is not None:
            raise GroupFailedError(f"the replica group has failed: {self.dead_error}")
        try:
            results = self._broadcast(step)
        except Exception as exc:
            raise self._fail(exc) from exc
        return results[self.output_rank]

    def execute_async(self, step: SchedulerOutput) -> PendingOutput:
        """The step runs while the caller goes on (several may be in flight); `result()` waits."""
        import ray

        if self.dead_error is not None:
            raise GroupFailedError(f"the replica group has failed: {self.dead_error}")
        parking = self._parking  # only with the compiled graph
        try:
            if parking is not None:
                parking.step_started()
            ref = self._dag.execute(step) if self._dag is not None else \
                [w.execute_step.remote(step) for w in self.workers]
        except Exception as exc:
            if parking is not None:
                parking.step_done()
            raise self._fail(exc) from exc

        def finish() -> RunnerOutput:
            try:
                return ray.get(ref, timeout=self.step_timeout_s)[self.output_rank]
            except Exception as exc:
                raise self._fail(exc) from exc
            finally:
                if parking is not None:
                    parking.step_done()

        return PendingOutput(finish)

    def _broadcast(self, step: SchedulerOutput) -> list[Any]:
        import ray

        if self._dag is None:
            return ray.get([w.execute_step.remote(step) for w in self.workers], timeout=self.step_timeout_s)
        parking = self._parking
        try:
            if parking is not None:
                parking.step_started()
            return ray.get(self._dag.execute(step), timeout=self.step_timeout_s)
        finally:
            if parking is not None:
                parking.step_done()

    # ---- idle parking (workers/executor/parking.py) -----------------------------------------------
    @property
    def parked(self) -> bool:
        """Whether the workers are parked now (waiting off the CPU for the next step)."""
        return self._parking is not None and self._parking.parked

    def _park(self) -> Any:
        return self._dag.execute(Park())

    def _unpark(self, parked: Any, timeout_s: float) -> None:
        import ray

        for w in self.workers:
            w.unpark.remote()
        ray.get(parked, timeout=timeout_s)

    # ---- KV blocks: host tier and transfer between groups --------------------------------------------
    def kv_bytes_per_block(self) -> int:
        import ray

        return sum(ray.get([w.kv_bytes_per_block.remote() for w in self.workers]))

    def init_host_cache(self, num_slots: int) -> None:
        import ray

        ray.get([w.init_host_cache.remote(num_slots) for w in self.workers])

    def export_blocks(self, block_ids: list[int]) -> list[Any]:
        """Object refs, one per rank: the data go worker to worker through the object store."""
        return [w.export_blocks.remote(block_ids) for w in self.workers]

    def import_host_blocks(self, slots: list[int], per_rank: list[Any]) -> None:
        import ray

        ray.get([w.import_host_blocks.remote(slots, data) for w, data in zip(self.workers, per_rank)],
                timeout=self.step_timeout_s)

    def _fail(self, exc: BaseException) -> GroupFailedError:
        """Kill the whole group (peers may be blocked in a collective with the failed worker)."""
        error = describe_failure(exc, self.workers, self.worker_info, self.tp)
        dead = self.probe_workers().dead
        if dead and not error.startswith(f"worker {dead[0]} "):
            # A survivor's collective broke first; name the worker whose death caused it.
            error = f"worker {', '.join(dead)} died ({error})"
        self._give_up(error)
        return GroupFailedError(error)

    def fail(self, reason: str) -> None:
        """Give the group up from outside a step (a watchdog found a worker dead): kill the
        rest; every later step raises."""
        if self.dead_error is None:
            self._give_up(reason)

    def _give_up(self, error: str) -> None:
        self.dead_error = error
        logger.error("replica group failed: %s", error)
        self._teardown(failed=True)

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.worker_info]

    def probe_workers(self, timeout_s: float = 2.0) -> WorkerProbe:
        """Ray's built-in no-op call to every worker. Cheap, and it runs beside the compiled
        graph's loop, so a watchdog may call it between steps. A worker whose process is gone is
        dead; one that does not answer within `timeout_s` is silent (busy, or stopped: only a
        silence that lasts tells); one unreachable for a moment (Ray's ActorUnavailableError)
        is neither."""
        import ray
        from ray.exceptions import ActorDiedError

        refs = [w.__ray_ready__.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        probe = WorkerProbe()
        for rank, ref in enumerate(refs):
            if ref not in ready:
                probe.silent.append(rank_name(rank, self.tp))
                continue
            try:
                ray.get(ref)
            except ActorDiedError:
                probe.dead.append(rank_name(rank, self.tp))
            except Exception:  # noqa: BLE001 - not known dead: the next probe or step tells
                pass
        return probe

    def measure_control_overhead(self, num_steps: int = 200) -> dict[str, float]:
        """Median ms of an empty step round trip: this executor's path vs plain actor calls.

        Interleaved, so both see the same machine load. An empty step (no requests) does
        no model work, so what is left is the cost of reaching every worker and back.
        """
        import ray

        empty = SchedulerOutput(step_id=-1)
        times: dict[str, list[float]] = {"step_ms": [], "actor_calls_ms": []}
        for _ in range(num_steps):
            start = time.perf_counter()
            self.execute(empty)
            times["step_ms"].append(time.perf_counter() - start)
            start = time.perf_counter()
            ray.get([w.execute_step.remote(empty) for w in self.workers])
            times["actor_calls_ms"].append(time.perf_counter() - start)
        return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()} | {
            "compiled_graph": self._dag is not None, "num_workers": len(self.workers)}

    def device_pins(self) -> list[DevicePin]:
        """Each rank's node and GPUs, in rank order (for a draft model that shares them)."""
        return [DevicePin(w["node_id"], tuple(int(g) for g in w.get("gpu_ids", []))) for w in self.worker_info]

    # ---- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._teardown()

    def abandon(self) -> None:
        """Kill the workers and wait for nothing: the compiled graph's teardown would wait for
        a stopped worker's loop, and the replica, ending, for the teardown. Ray ends what is
        left (the graph's driver, the placement group) with the replica's process."""
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []

    def _teardown(self, failed: bool = False) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._parking is not None:
            # Parked workers are not in the graph's loop, which a teardown waits for.
            self._parking.close(unpark=not failed)
            self._parking = None
        if self._dag is not None and not failed:
            quiet_teardown(self._dag, logging.WARNING)
        for w in self.workers:
            # kill, not exit: a worker may be blocked in a collective
            try:
                ray.kill(w)
            except Exception:  # pragma: no cover - already gone
                pass
        if self._dag is not None and failed:
            quiet_teardown(self._dag, logging.CRITICAL)
        self._dag = None
        self.workers = []
        if self.placement_group is not None and self._owns_placement_group:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # pragma: no cover
                pass
        self.placement_group = None

