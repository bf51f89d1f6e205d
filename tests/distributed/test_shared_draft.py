"""A draft with its own tensor-parallel size, and one draft actor shared by several groups."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _info(llm: LLM) -> dict:
    import ray

    return ray.get(llm.engine.proposer.core.describe.remote())


@pytest.mark.parametrize("group_tp", [1, 2])
def test_a_tp2_draft_keeps_greedy_output(ray_local, llama_dir: str, group_tp: int) -> None:
    prompts = mixed_prompts(seed=61, lengths=(7, 19))
    llm = LLM(llama_dir, tensor_parallel_size=group_tp, speculative_model=llama_dir, num_speculative_tokens=3,
              speculative_draft_tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
    try:
        info = _info(llm)
        assert len(info["ranks"]) == 2  # the draft's two TP ranks, Worker actors on the group's node
        assert info["placement"].startswith("the group's first device")
        assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, 12)
        # The draft is the target: every draft token is accepted.
        assert llm.engine.num_accepted_draft_tokens == llm.engine.num_draft_tokens > 0
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()


def test_two_groups_share_one_draft_actor(ray_local, llama_dir: str) -> None:
    import ray

    name = "test-shared-draft"
    options = dict(speculative_model=llama_dir, num_speculative_tokens=2, speculative_draft_actor_name=name,
                   block_size=4, num_kv_blocks=64)
    first, second = LLM(llama_dir, **options), LLM(llama_dir, tensor_parallel_size=2, **options)
    try:
        actor = ray.get_actor(name, namespace="tandem")
        a, b = first.engine.proposer, second.engine.proposer
        assert a.core._actor_id == b.core._actor_id == actor._actor_id  # one actor, two groups
        assert a.namespace != b.namespace and sorted(_info(first)["attached"]) == sorted([a.namespace, b.namespace])
        prompts = mixed_prompts(seed=62, lengths=(9, 14, 23))
        expected = hf_greedy(llama_dir, prompts, 12)
        assert _generate(first, prompts) == expected
        assert _generate(second, prompts) == expected
        for llm in (first, second):
            assert llm.engine.num_accepted_draft_tokens == llm.engine.num_draft_tokens > 0
        first.shutdown()
        assert _info(second)["attached"] == [b.namespace]  # the other group's detach left it up
        assert _generate(second, prompts[:1]) == expected[:1]
    finally:
        first.shutdown()
        second.shutdown()
    with pytest.raises(ValueError):  # the last group to leave ended it
        ray.get_actor(name, namespace="tandem")


def test_a_killed_shared_draft_is_started_again(ray_local, llama_dir: str) -> None:
    import ray

    name = "test-restarted-draft"
    llm = LLM(llama_dir, speculative_model=llama_dir, num_speculative_tokens=2, speculative_draft_actor_name=name,
              block_size=4, num_kv_blocks=64)
    try:
        prompts = mixed_prompts(seed=63, lengths=(10, 17))
        expected = hf_greedy(llama_dir, prompts, 12)
        assert _generate(llm, prompts) == expected
        ray.kill(ray.get_actor(name, namespace="tandem"))
        assert _generate(llm, prompts) == expected  # without drafts while it restarts
        proposer = llm.engine.proposer
        assert proposer.num_restarts == 1
        _wait_until_up(proposer)
        accepted = llm.engine.num_accepted_draft_tokens
        assert _generate(llm, prompts) == expected
        assert llm.engine.num_accepted_draft_tokens > accepted  # drafting again
        assert _info(llm)["attached"] == [proposer.namespace]
    finally:
        llm.shutdown()


def test_groups_must_agree_on_a_shared_draft(ray_local, llama_dir: str) -> None:
    options = dict(speculative_model=llama_dir, speculative_draft_actor_name="test-clash", block_size=4,
                   num_kv_blocks=64)
    llm = LLM(llama_dir, num_speculative_tokens=2, **options)
    try:
        with pytest.raises(ValueError, match="other k"):
            LLM(llama_dir, num_speculative_tokens=3, **options)
    finally:
        llm.shutdown()


def test_a_draft_whose_rank_dies_is_replaced_and_the_requests_never_notice(ray_local, llama_dir: str) -> None:
    import ray

    llm = LLM(llama_dir, speculative_model=llama_dir, num_speculative_tokens=2,
              speculative_draft_tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
    try:
        prompts = mixed_prompts(seed=64, lengths=(11, 16))
        expected = hf_greedy(llama_dir, prompts, 12)
        assert _generate(llm, prompts) == expected
        proposer = llm.engine.proposer
        ray.kill(ray.get(proposer.core.worker_handles.remote())[1])  # one of the draft's TP ranks
        assert _generate(llm, prompts) == expected  # verified without drafts meanwhile
        assert proposer.num_restarts >= 1
        _wait_until_up(proposer)
        accepted = llm.engine.num_accepted_draft_tokens
        assert _generate(llm, prompts) == expected
        assert llm.engine.num_accepted_draft_tokens > accepted  # a new draft, both ranks up
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()


def _wait_until_up(proposer) -> None:
    """Block until the restarted draft has loaded. (Stepping the engine meanwhile works too,
    but on two cores a busy engine leaves the new draft's processes almost no CPU.)"""
    import ray

    if proposer._starting is not None:
        ray.get(proposer._starting, timeout=120)
