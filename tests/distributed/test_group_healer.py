"""A TP=2 group whose worker dies, or stops answering while idle, starts new workers in place and
serves the same greedy tokens again; the heal budget, a failed rebuild and a rebuild that takes too long leave the
group to Serve (its health check fails)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest

from tandem.workers.config import EngineConfig
from tandem.workers.core.request import SamplingParams
from tandem.workers.engine.async_engine import AsyncEngine
from tandem.workers.engine.builder import build_engine, rebuild_engine
from tandem.workers.executor.abstract import WorkerProbe
from tandem.workers.serving.group_healer import GroupHealer, HealPolicy
from tests import shared_ray
from tests.conftest import hf_greedy, mixed_prompts, tiny_model

LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


async def _generate(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str):
    return [out async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id)]


async def _first_token_then(engine: AsyncEngine, prompt: list[int], request_id: str, kill) -> list:
    outs = []
    async for out in engine.generate({"prompt_token_ids": prompt}, LONG, request_id):
        if not outs:
            kill()
        outs.append(out)
    return outs


def _pids(engine: AsyncEngine) -> list[int]:
    return engine.worker_pids()


@pytest.mark.slow
def test_a_killed_worker_is_replaced_in_place_and_the_group_serves_the_same_tokens(ray_local) -> None:
    model = tiny_model("llama")
    prompts = mixed_prompts(seed=5)
    config = EngineConfig.from_options(model=model, tensor_parallel_size=2, num_kv_blocks=64, block_size=4)
    engine = AsyncEngine(build_engine(config, show_progress=False))
    swapped = []
    healer = GroupHealer(engine, rebuild_engine, swapped.append,
                         HealPolicy(max_rebuilds=3, probe_interval_s=0.5, silent_s=3.0))
    try:
        before = _pids(engine)
        # SIGKILL, as the OOM killer would: the worker's process is gone mid-stream.
        outs = asyncio.run(_first_token_then(engine, prompts[0], "long", lambda: os.kill(before[1], signal.SIGKILL)))
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
        assert "worker pp_rank=0 tp_rank=1 died" in outs[-1].error
        healer.check()  # being rebuilt: Serve's health check passes
        assert _wait(lambda: healer.num_rebuilds == 1 and engine.is_healthy, timeout_s=60)
        assert not healer.healing and swapped == [engine.engine]
        after = _pids(engine)
        assert len(after) == 2 and not set(after) & set(before)
        got = [asyncio.run(_generate(engine, p, GREEDY, f"g{i}")) for i, p in enumerate(prompts)]
        assert [[t for out in outs for t in out.outputs[0].token_ids] for outs in got] == hf_greedy(model, prompts, 8)
        assert engine.engine.scheduler.stats()["kv_blocks_free"] == 64  # nothing held after the requests

        # A worker that dies while the group is idle: the probe finds it, no request needed.
        idle_pids = _pids(engine)
        os.kill(idle_pids[0], signal.SIGKILL)
        assert _wait(lambda: healer.num_rebuilds == 2 and engine.is_healthy, timeout_s=60)
        assert not set(_pids(engine)) & set(idle_pids)
        assert "worker pp_rank=0 tp_rank=0 died (found between steps)" in swapped[0].dead_error
        # A worker stopped (SIGSTOP) while the group is idle: alive, but it answers no probe.
        stopped_pids = _pids(engine)
        os.kill(stopped_pids[1], signal.SIGSTOP)
        try:
            assert _wait(lambda: healer.num_rebuilds == 3 and engine.is_healthy, timeout_s=60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the rebuild killed it, or this does
                os.kill(stopped_pids[1], signal.SIGKILL)
        assert not set(_pids(engine)) & set(stopped_pids)
        assert "worker pp_rank=0 tp_rank=1 answered no probe for 3 s between steps" in swapped[1].dead_error
        # Once more than the policy allows: the group is left failed for Serve.
        os.kill(_pids(engine)[0], signal.SIGKILL)
        assert _wait(lambda: healer.gave_up is not None, timeout_s=30)
        assert "after 3 rebuilds within 600 s" in healer.gave_up and not engine.is_healthy
        with pytest.raises(RuntimeError, match="after 3 rebuilds"):
            healer.check()
    finally:
        healer.close()
        engine.shutdown()
    assert shared_ray.leftovers_after(15) == []  # three failed groups' workers and graph proxies, all gone


class _FakeEngine:
    """What GroupHealer touches of an AsyncEngine's engine."""

    def __init__(self, error: str | None = None) -> None:
        self.dead_error = error
        self.num_kv_blocks = 8
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True


class _FakeAsyncEngine:
    def __init__(self) -> None:
        self.listeners = []
        self.engine = _FakeEngine()

    def add_failure_listener(self, listener) -> None:
        self.listeners.append(listener)

    @property
    def dead_error(self) -> str | None:
        return self.engine.dead_error

    silent: list[str] = []  # ranks that answer no probe
    step_for: float = 0.0  # seconds the step running now has taken (0: between steps)
    num_probes: int = 0

    def probe_workers(self) -> WorkerProbe:
        self.num_probes += 1
        return WorkerProbe(silent=list(self.silent))

    def probed(self) -> None:
        """Waits for two more probes: the second ran wholly after what the test just changed
        (a sleep would not do: a loaded host can hold the healer's thread for longer)."""
        target = self.num_probes + 2
        assert _wait(lambda: self.num_probes >= target, timeout_s=30)

    def step_running_for(self) -> float:
        return self.step_for

    def fail_engine(self, error: str) -> None:
        self.fail(error)

    def fail(self, error: str) -> None:
        self.engine.dead_error = error
        for listener in self.listeners:
            listener(self.engine)

    def replace_engine(self, engine, on_swapped=None) -> None:
        self.engine = engine
        if on_swapped is not None:
            on_swapped(engine)


def test_a_rebuild_that_fails_leaves_the_group_to_serve() -> None:
    fake = _FakeAsyncEngine()

    def rebuild(failed):
        raise RuntimeError("no bundle for the new worker")

    healer = GroupHealer(fake, rebuild, policy=HealPolicy(max_rebuilds=3))
    try:
        fake.fail("worker pp_rank=0 tp_rank=1 died")
        assert _wait(lambda: healer.gave_up is not None, timeout_s=10)
        assert healer.gave_up == ("the group failed (worker pp_rank=0 tp_rank=1 died) and could not be rebuilt: "
                                  "no bundle for the new worker")
        assert not healer.healing and healer.num_rebuilds == 0
        with pytest.raises(RuntimeError, match="could not be rebuilt"):
            healer.check()
    finally:
        healer.close()


def test_a_rebuild_slower_than_the_timeout_fails_the_health_check_and_its_engine_is_dropped() -> None:
    fake = _FakeAsyncEngine()
    now = [100.0]
    started, go, built = threading.Event(), threading.Event(), []

    def rebuild(failed):
        started.set()
        go.wait(10)
        built.append(_FakeEngine())
        return built[-1]

    healer = GroupHealer(fake, rebuild, policy=HealPolicy(timeout_s=30.0), clock=lambda: now[0])
    try:
        fake.fail("worker pp_rank=0 tp_rank=0 died")
        assert healer.healing and started.wait(10)
        now[0] = 129.0
        healer.check()  # within the timeout
        now[0] = 131.0
        with pytest.raises(RuntimeError, match="not rebuilt within 30 s"):
            healer.check()
        go.set()
        assert _wait(lambda: built and built[0].shut, timeout_s=10)  # built too late: shut, never swapped in
        assert fake.engine.dead_error is not None and healer.num_rebuilds == 0
    finally:
        healer.close()


def test_a_worker_silent_between_steps_for_silent_s_fails_the_group_and_it_heals() -> None:
    """A stopped worker (SIGSTOP) of an idle group answers no probe: once that lasts silent_s,
    the group fails and is rebuilt in place; while a step runs, silence is the stall watchdog's."""
    fake = _FakeAsyncEngine()
    fake.silent = ["pp_rank=0 tp_rank=1"]
    now = [0.0]
    rebuilt = []

    def rebuild(failed):
        rebuilt.append(_FakeEngine())
        return rebuilt[-1]

    healer = GroupHealer(fake, rebuild, policy=HealPolicy(probe_interval_s=0.01, silent_s=10.0),
                         clock=lambda: now[0])
    try:
        fake.step_for = 3.0  # a step runs: silence does not count
        now[0] = 50.0
        fake.probed()
        assert fake.engine.dead_error is None
        fake.step_for = 0.0
        fake.probed()  # the first silent probe between steps starts the count
        now[0] = 59.0
        fake.probed()
        assert fake.engine.dead_error is None and not rebuilt  # silent 9 s of 10
        fake.silent = []  # it answered: the count starts again
        fake.probed()
        fake.silent = ["pp_rank=0 tp_rank=1"]
        fake.probed()
        now[0] = 68.0
        fake.probed()
        assert not rebuilt
        now[0] = 69.5
        assert _wait(lambda: rebuilt and fake.engine is rebuilt[0], timeout_s=10)
        assert healer.num_rebuilds == 1
    finally:
        healer.close()


def test_heal_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="max_rebuilds must be >= 0"):
        HealPolicy(max_rebuilds=-1)
    for bad in ({"timeout_s": 0}, {"window_s": -1.0}, {"probe_interval_s": 0}, {"silent_s": 0}):
        with pytest.raises(ValueError, match="window_s, timeout_s, probe_interval_s and silent_s > 0"):
            HealPolicy(**bad)
