"""A Ray group's idle workers wait off the CPU (parked) and wake for the next step.

First `IdleParking`'s clock and hand-offs with a fake group (a list of what was called),
then a real TP group: the same tokens before and after a park, and a worker that dies
while parked fails the group cleanly."""

from __future__ import annotations

import time

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.engine.engine_dead import EngineDeadError
from tandem.workers.executor.parking import IdleParking
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts, tiny_model


class FakeGroup:
    def __init__(self, fail_unpark: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_unpark = fail_unpark

    def park(self) -> str:
        self.calls.append("park")
        return f"park-{self.calls.count('park')}"

    def unpark(self, handle: str, timeout_s: float) -> None:
        self.calls.append(f"unpark {handle} {timeout_s:g}")
        if self.fail_unpark:
            raise RuntimeError("worker 1 died")


def _wait_parked(parking: IdleParking, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not parking.parked:
        assert time.monotonic() < deadline, "the workers were never parked"
        time.sleep(0.01)


def test_parks_after_idle_and_unparks_before_the_next_step() -> None:
    group = FakeGroup()
    parking = IdleParking(0.05, group.park, group.unpark, unpark_timeout_s=7.0)
    _wait_parked(parking)
    assert group.calls == ["park"] and parking.num_parks == 1
    parking.step_started()
    assert group.calls == ["park", "unpark park-1 7"] and not parking.parked
    parking.step_done()
    _wait_parked(parking)  # idle again: parked again, once
    time.sleep(0.15)
    assert group.calls == ["park", "unpark park-1 7", "park"] and parking.num_parks == 2
    parking.close()
    assert group.calls[-1] == "unpark park-2 7"  # a teardown finds the workers in their loops


def test_never_parks_while_a_step_is_in_flight() -> None:
    group = FakeGroup()
    parking = IdleParking(0.05, group.park, group.unpark, unpark_timeout_s=1.0)
    parking.step_started()
    parking.step_started()  # two in flight (a step scheduled ahead of the last one's result)
    parking.step_done()
    time.sleep(0.2)
    assert group.calls == [] and not parking.parked
    parking.step_done()
    _wait_parked(parking)
    parking.close(unpark=False)  # a failed group's workers are killed, not woken
    assert group.calls == ["park"]


def test_an_unpark_that_fails_fails_the_step_and_the_clock_stays_balanced() -> None:
    group = FakeGroup(fail_unpark=True)
    parking = IdleParking(0.05, group.park, group.unpark, unpark_timeout_s=1.0)
    _wait_parked(parking)
    with pytest.raises(RuntimeError, match="worker 1 died"):
        parking.step_started()
    parking.step_done()  # what the executor's `finally` does
    assert not parking.parked
    parking.close(unpark=False)  # the executor fails the group
    assert group.calls == ["park", "unpark park-1 1"]


def test_a_step_right_after_start_up_never_waits_for_a_park() -> None:
    group = FakeGroup()
    parking = IdleParking(60.0, group.park, group.unpark, unpark_timeout_s=1.0)
    parking.step_started()
    parking.step_done()
    parking.close()
    assert group.calls == []


def test_park_after_must_be_positive() -> None:
    group = FakeGroup()
    with pytest.raises(ValueError, match="park_workers_after_s: must be > 0"):
        IdleParking(0.0, group.park, group.unpark, unpark_timeout_s=1.0)


MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _wait_group_parked(llm: LLM, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not llm.engine.executor.parked:
        assert time.monotonic() < deadline, "the idle group's workers were never parked"
        time.sleep(0.05)


def _cpu_seconds(llm: LLM) -> list[float]:
    """Each worker process's CPU time so far (all its threads: the graph's loop included)."""
    import ray

    return ray.get([w.__ray_call__.remote(lambda worker: time.process_time()) for w in llm.engine.executor.workers])


@pytest.mark.slow
def test_an_idle_group_parks_its_workers_and_the_next_steps_give_the_same_tokens(ray_local) -> None:
    model = tiny_model("llama")
    prompts = mixed_prompts(seed=5)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    # Parking is the compiled graph's (plain actor calls wait off the CPU anyway): on here.
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, park_workers_after_s=0.2,
              compiled_graph=True)
    try:
        batch = [{"prompt_token_ids": p} for p in prompts]
        assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
        _wait_group_parked(llm)
        # Parked, a worker uses next to no CPU; in the graph's polling read it would use a core.
        before = _cpu_seconds(llm)
        time.sleep(1.0)
        used = [after - b for after, b in zip(_cpu_seconds(llm), before)]
        assert llm.engine.executor.parked and max(used) < 0.25, used
        # The next generate wakes them; every request after it too (parked again in between).
        # A park counts each wake-up and new idle spell: at least one a generate. A generate on a
        # loaded machine may leave its own gap of 0.2 s between two steps (the process not run for
        # that long) and park there too, which is the parking's design, not a failure.
        parking = llm.engine.executor._parking
        for _ in range(2):
            num_parks = parking.num_parks
            assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
            _wait_group_parked(llm)
            assert parking.num_parks > num_parks
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()  # from parked: the teardown wakes them first, and does not hang


@pytest.mark.slow
def test_never_parked_when_asked_not_to(ray_local) -> None:
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, park_workers_after_s=None)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        time.sleep(0.5)
        assert llm.engine.executor._parking is None and not llm.engine.executor.parked
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_worker_killed_while_parked_fails_the_next_step_and_frees_its_blocks(ray_local) -> None:
    import ray

    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, park_workers_after_s=0.2,
              compiled_graph=True)
    try:
        _wait_group_parked(llm)
        ray.kill(llm.engine.executor.workers[1])
        [out] = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY, use_tqdm=False)
        assert out.outputs[0].finish_reason == "error"
        assert "worker pp_rank=0 tp_rank=1" in out.error, out.error
        llm.engine.pool.check_all_free()
        with pytest.raises(EngineDeadError, match="replica group has failed"):
            llm.engine.add_request("late", "hello")
    finally:
        llm.shutdown()
