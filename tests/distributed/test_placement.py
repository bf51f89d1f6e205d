"""Placement: a stage's TP ranks on one node, stages free to span nodes, unplaceable layouts
refused up front with what was asked and what the cluster has, spare GPUs reported."""

from __future__ import annotations

import time

import pytest

from tandem.cluster.placement import NodeResources, PlacementError, plan_placement


def _node(name: str, gpus: float = 0, cpus: float = 2, free_gpus: float | None = None) -> NodeResources:
    total = {"CPU": cpus, "GPU": gpus}
    return NodeResources(name * 8, "10.0.0." + str(len(name)), total,
                         dict(total, GPU=gpus if free_gpus is None else free_gpus))


# ---- the planner (pure) ------------------------------------------------------------------------
def test_stages_span_nodes_when_a_node_holds_one_stage() -> None:
    plan = plan_placement(2, 2, [_node("a", 2), _node("b", 2)], use_gpu=True)
    assert plan.stage_nodes == ("a" * 8, "b" * 8)
    assert plan.bundles == [{"GPU": 1.0}] * 4
    assert [s["ray.io/node-id"] for s in plan.bundle_label_selector] == ["a" * 8] * 2 + ["b" * 8] * 2
    assert plan.spare_gpus == {}


def test_stages_pack_on_one_node_when_it_fits_and_spares_are_reported() -> None:
    # Best fit: both stages go to the 4-GPU node; the 8-GPU node stays whole for others.
    plan = plan_placement(2, 2, [_node("big", 8), _node("mid", 4)], use_gpu=True)
    assert plan.stage_nodes == ("mid" * 8, "mid" * 8)
    assert plan.spare_gpus == {"big" * 8: 8}


def test_gpus_in_use_are_not_offered() -> None:
    plan = plan_placement(2, 1, [_node("a", 4, free_gpus=1), _node("b", 4, free_gpus=3)], use_gpu=True)
    assert plan.stage_nodes == ("b" * 8,)
    assert plan.spare_gpus == {"a" * 8: 1, "b" * 8: 1}


def test_tp_wider_than_any_node_is_refused_with_what_was_asked_and_what_exists() -> None:
    with pytest.raises(PlacementError) as err:
        plan_placement(4, 1, [_node("a", 2), _node("b", 2)], use_gpu=True)
    msg = str(err.value)
    assert "tensor_parallel_size=4 x pipeline_parallel_size=1" in msg
    assert "4 GPU per node" in msg
    assert "aaaaaaaa (10.0.0.1): 2 of 2 free" in msg and "(4 free in all)" in msg


def test_too_many_stages_is_refused() -> None:
    with pytest.raises(PlacementError, match="only 1 stage"):
        plan_placement(2, 2, [_node("a", 2), _node("b", 0)], use_gpu=True)


def test_cpu_groups_use_cpu_bundles() -> None:
    plan = plan_placement(2, 2, [_node("a", cpus=8)], use_gpu=False)
    assert plan.bundles == [{"CPU": 1.0}] * 4
    assert plan.stage_nodes == ("a" * 8,) * 2
    with pytest.raises(PlacementError, match="CPU"):
        plan_placement(2, 2, [_node("a", cpus=3)], use_gpu=False)


# ---- a simulated two-node GPU cluster ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_tp2_pp2_group_puts_each_stage_on_its_own_node(two_node_cluster) -> None:
    from tandem.cluster.placement import plan_on_cluster, spare_gpus
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM
    from tests.conftest import hf_greedy, tiny_model

    _, nodes = two_node_cluster
    gpu_nodes = {n.node_id for n in nodes}
    model = tiny_model("llama")
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        executor = llm.engine.executor
        assert executor.plan.use_gpu and executor.plan.bundles == [{"GPU": 1.0}] * 4
        info = executor.worker_info
        stage_nodes = [{w["node_id"] for w in info[s * 2:(s + 1) * 2]} for s in range(2)]
        assert all(len(nodes_of_stage) == 1 for nodes_of_stage in stage_nodes)  # TP ranks packed
        assert stage_nodes[0] != stage_nodes[1]  # the stages on different nodes
        assert stage_nodes[0] | stage_nodes[1] == gpu_nodes
        assert sorted(len(w["gpu_ids"]) for w in info) == [1, 1, 1, 1]  # one (logical) GPU each
        assert spare_gpus() == {}  # the group holds all four
        # Logical GPUs, no CUDA: the workers run on CPU with gloo, and still match transformers.
        out = llm.generate([{"prompt_token_ids": [21, 22, 23, 24]}],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(model, [[21, 22, 23, 24]], 6)[0]
    finally:
        llm.shutdown()
    # Right after shutdown the GPUs may still be on their way back: planning a rebuild waits
    # for them instead of failing.
    assert plan_on_cluster(2, 2, use_gpu=True).stage_nodes != ()
    assert sum(spare_gpus().values()) == 4


@pytest.mark.slow
def test_unplaceable_layout_fails_fast_with_a_clear_message(two_node_cluster) -> None:
    from tandem.workers.llm import LLM
    from tests.conftest import tiny_model

    start = time.monotonic()
    with pytest.raises(PlacementError) as err:
        LLM(tiny_model("llama"), tensor_parallel_size=4)
    assert time.monotonic() - start < 5.0
    msg = str(err.value)
    assert "tensor_parallel_size=4 x pipeline_parallel_size=1" in msg
    assert "4 GPU per node" in msg and "2 of 2 free" in msg


@pytest.mark.slow
def test_group_inside_a_replica_uses_the_replicas_placement_group(two_node_cluster) -> None:
    """A Serve replica reserves one bundle for itself and one per worker; the engine it builds
    puts its workers in those bundles instead of reserving more."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tests.conftest import tiny_model

    @ray.remote(num_cpus=1)
    class Replica:
        def run(self, model: str) -> dict:
            from tandem.workers.core.request import SamplingParams
            from tandem.workers.llm import LLM

            llm = LLM(model, tensor_parallel_size=2)
            try:
                executor = llm.engine.executor
                out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
                return {"plan": executor.plan, "first": executor.bundles.first, "tokens": out[0].outputs[0].token_ids,
                        "nodes": [w["node_id"] for w in executor.worker_info]}
            finally:
                llm.shutdown()

    pg = placement_group([{"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=30)
    try:
        replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
        result = ray.get(replica.run.remote(tiny_model("llama")), timeout=120)
        assert result["plan"] is None and result["first"] == 1  # no placement group of its own
        expected_node = placement_group_table(pg)["bundles_to_node_id"][1]
        assert result["nodes"] == [expected_node] * 2
        assert len(result["tokens"]) == 4
        assert placement_group_table(pg)["state"] == "CREATED"  # left to its owner
        ray.kill(replica)
    finally:
        remove_placement_group(pg)
