"""Where a draft goes: spare GPUs of one node first, else the group's own devices."""

from __future__ import annotations

import pytest

from tandem.cluster.placement import DevicePin
from tandem.workers.spec.draft_proposer import plan_draft

N1, N2 = "a1" * 28, "b2" * 28  # node ids are 28-byte hex strings
GPU_GROUP = [DevicePin(N1, (0,)), DevicePin(N1, (1,))]


def _node(options: dict) -> str:
    return options["scheduling_strategy"].node_id


def test_a_tp1_draft_takes_a_spare_gpu_on_the_node_with_most() -> None:
    plan = plan_draft(1, GPU_GROUP, {N1: 1, N2: 3})
    assert plan.where == f"a spare GPU on node {N2}" and plan.spare and plan.pins is None
    assert plan.actor_options["num_gpus"] == 1 and _node(plan.actor_options) == N2


def test_a_tp2_draft_needs_two_spare_gpus_on_one_node() -> None:
    plan = plan_draft(2, GPU_GROUP, {N1: 1, N2: 2})
    assert plan.where == f"2 spare GPUs on node {N2}" and plan.pins is None
    assert plan.actor_options["num_gpus"] == 0  # its Worker actors reserve the GPUs
    shared = plan_draft(2, GPU_GROUP, {N1: 1, N2: 1})  # two spare, but not on one node
    assert shared.where.startswith("the group's first 2 devices") and shared.pins == GPU_GROUP


def test_without_spare_gpus_the_draft_sees_the_groups_first_device() -> None:
    plan = plan_draft(1, GPU_GROUP, {})
    assert plan.where.startswith("the group's first device") and not plan.spare
    assert plan.actor_options["num_gpus"] == 0 and _node(plan.actor_options) == N1
    assert plan.actor_options["runtime_env"] == {"env_vars": {"CUDA_VISIBLE_DEVICES": "0"}}


def test_on_cpus_every_draft_rank_goes_to_the_groups_first_node() -> None:
    plan = plan_draft(3, [DevicePin(N1), DevicePin(N2)], {})
    assert plan.pins == [DevicePin(N1)] * 3 and "runtime_env" not in plan.actor_options


def test_a_draft_wider_than_what_it_could_share_is_refused() -> None:
    with pytest.raises(ValueError, match="speculative_draft_tensor_parallel_size=4: no node has 4 spare GPUs"):
        plan_draft(4, GPU_GROUP, {N2: 3})
