"""A Ray group's idle workers wait off the CPU (parked) and wake for the next step: the same
tokens, before and after, and a worker that dies while parked fails the group cleanly."""

from __future__ import annotations

import time

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.engine.group_engine import EngineDeadError
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts, tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _wait_parked(llm: LLM, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not llm.engine.executor.parked:
        assert time.monotonic() < deadline, "the idle group's workers were never parked"
        time.sleep(0.05)


def _cpu_seconds(llm: LLM) -> list[float]:
    """Each worker process's CPU time so far (all its threads: the graph's loop included)."""
    import ray

    return ray.get([w.__ray_call__.remote(lambda worker: time.process_time()) for w in llm.engine.executor.workers])


def test_an_idle_group_parks_its_workers_and_the_next_steps_give_the_same_tokens(ray_local) -> None:
    model = tiny_model("llama")
    prompts = mixed_prompts(seed=5)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, park_workers_after_s=0.2)
    try:
        batch = [{"prompt_token_ids": p} for p in prompts]
        assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
        _wait_parked(llm)
        # Parked, a worker uses next to no CPU; in the graph's polling read it would use a core.
        before = _cpu_seconds(llm)
        time.sleep(1.0)
        used = [after - b for after, b in zip(_cpu_seconds(llm), before)]
        assert llm.engine.executor.parked and max(used) < 0.25, used
        # The next generate wakes them; every request after it too (parked again in between).
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
            _wait_parked(llm)
        assert llm.engine.executor._parking.num_parks == 3
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()  # from parked: the teardown wakes them first, and does not hang


def test_never_parked_when_asked_not_to(ray_local) -> None:
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, park_workers_after_s=None)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        time.sleep(0.5)
        assert llm.engine.executor._parking is None and not llm.engine.executor.parked
    finally:
        llm.shutdown()


def test_a_worker_killed_while_parked_fails_the_next_step_and_frees_its_blocks(ray_local) -> None:
    import ray

    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, park_workers_after_s=0.2)
    try:
        _wait_parked(llm)
        ray.kill(llm.engine.executor.workers[1])
        [out] = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY, use_tqdm=False)
        assert out.outputs[0].finish_reason == "error"
        assert "worker pp_rank=0 tp_rank=1" in out.error, out.error
        llm.engine.pool.check_all_free()
        with pytest.raises(EngineDeadError, match="replica group has failed"):
            llm.engine.add_request("late", "hello")
    finally:
        llm.shutdown()
