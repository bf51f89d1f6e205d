"""The draft model goes to a GPU no group uses; with none spare it shares the group's first."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.three_gpu_node = cluster.add_node(num_cpus=2, num_gpus=3)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def three_gpu_node(cluster):
    return cluster.three_gpu_node


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _draft_where(llm: LLM) -> dict:
    import ray

    return ray.get(llm.engine.proposer.core.describe.remote())


def test_tp2_group_on_a_three_gpu_node_puts_its_draft_on_the_third_gpu(three_gpu_node, llama_dir: str) -> None:
    from tandem.cluster.placement import spare_gpus

    prompts = mixed_prompts(seed=51, lengths=(11,))
    llm = LLM(llama_dir, tensor_parallel_size=2, speculative_model=llama_dir, num_speculative_tokens=2)
    try:
        executor = llm.engine.executor
        assert llm.engine.proposer.placement.startswith("a spare GPU on node " + three_gpu_node.node_id)
        [where] = _draft_where(llm)["ranks"]  # the actor is up: its GPU is taken
        assert spare_gpus() == {}  # two GPUs for the group, the third for the draft
        assert where["node_id"] == three_gpu_node.node_id and len(where["gpu_ids"]) == 1
        group_gpus = {g for w in executor.worker_info for g in w["gpu_ids"]}
        assert len(group_gpus) == 2 and set(where["gpu_ids"]).isdisjoint(group_gpus)  # the third GPU
        assert _greedy(llm, prompts) == hf_greedy(llama_dir, prompts, 10)
        assert llm.engine.num_accepted_draft_tokens > 0
    finally:
        llm.shutdown()


def test_without_a_spare_gpu_the_draft_shares_the_first_device(three_gpu_node, llama_dir: str) -> None:
    import ray

    @ray.remote(num_gpus=1, num_cpus=0)
    class Occupant:  # another tenant holding the third GPU
        def ready(self) -> bool:
            return True

    occupant = Occupant.remote()
    ray.get(occupant.ready.remote())
    prompts = mixed_prompts(seed=52, lengths=(8,))
    llm = LLM(llama_dir, tensor_parallel_size=2, speculative_model=llama_dir, num_speculative_tokens=2)
    try:
        assert llm.engine.proposer.placement.startswith("the group's first device")
        [where] = _draft_where(llm)["ranks"]
        assert where["node_id"] == llm.engine.executor.worker_info[0]["node_id"]
        assert _greedy(llm, prompts) == hf_greedy(llama_dir, prompts, 10)
    finally:
        llm.shutdown()
        ray.kill(occupant)


def test_a_tp2_draft_goes_to_two_spare_gpus_of_one_node(cluster, llama_dir: str) -> None:
    two_gpu_node = cluster.add_node(num_cpus=2, num_gpus=2)  # the group fits here best
    cluster.wait_for_nodes()
    prompts = mixed_prompts(seed=53, lengths=(9,))
    llm = LLM(llama_dir, tensor_parallel_size=2, speculative_model=llama_dir, num_speculative_tokens=2,
              speculative_draft_tensor_parallel_size=2)
    try:
        group_nodes = {w["node_id"] for w in llm.engine.executor.worker_info}
        assert group_nodes == {two_gpu_node.node_id}
        node = cluster.three_gpu_node.node_id
        assert llm.engine.proposer.placement == f"2 spare GPUs on node {node}"
        ranks = _draft_where(llm)["ranks"]
        assert [r["node_id"] for r in ranks] == [node, node]
        assert all(len(r["gpu_ids"]) == 1 for r in ranks) and ranks[0]["gpu_ids"] != ranks[1]["gpu_ids"]
        assert _greedy(llm, prompts) == hf_greedy(llama_dir, prompts, 10)
        assert llm.engine.num_accepted_draft_tokens > 0
    finally:
        llm.shutdown()
        cluster.remove_node(two_gpu_node)


def test_without_two_spare_gpus_a_tp2_draft_shares_the_groups_devices(three_gpu_node, llama_dir: str) -> None:
    import ray

    @ray.remote(num_gpus=1, num_cpus=0)
    class Occupant:
        def ready(self) -> bool:
            return True

    occupant = Occupant.remote()
    ray.get(occupant.ready.remote())
    llm = LLM(llama_dir, tensor_parallel_size=2, speculative_model=llama_dir, num_speculative_tokens=2,
              speculative_draft_tensor_parallel_size=2)
    try:
        assert llm.engine.proposer.placement.startswith("the group's first 2 devices")
        group = llm.engine.executor.worker_info
        ranks = _draft_where(llm)["ranks"]
        # Each draft rank runs beside the group rank of the same index, seeing that rank's GPU.
        assert [r["node_id"] for r in ranks] == [w["node_id"] for w in group]
        assert [r["gpu_ids"] for r in ranks] == [[], []]  # nothing reserved a second time
        visible = [ray.get(w.describe.remote())["visible_devices"]
                   for w in ray.get(llm.engine.proposer.core.worker_handles.remote())]
        assert visible == [",".join(map(str, w["gpu_ids"])) for w in group]
    finally:
        llm.shutdown()
        ray.kill(occupant)
