"""A worker that dies or raises fails the whole group loudly and fast; the group can then be
shut down and rebuilt in the same process."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.engine.engine_dead import EngineDeadError
from tandem.workers.llm import LLM
from tests import shared_ray
from tests.conftest import hf_greedy, mixed_prompts, tiny_model

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _run_until_done(engine, deadline_s: float) -> dict[str, object]:
    finished = {}
    start = time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - start < deadline_s, "requests did not end after the worker failed"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_killed_worker_ends_requests_with_error_and_group_rebuilds(ray_local) -> None:
    import ray

    model = tiny_model("llama")
    prompts = mixed_prompts(seed=2)
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, LONG)
    for _ in range(3):
        engine.step()
    victim = engine.executor.workers[3]  # pp_rank=1, tp_rank=1
    # Kill from another thread while the loop keeps stepping, so the death lands mid-step.
    killer = threading.Timer(0.2, lambda: ray.kill(victim))
    killer.start()
    killed_at = time.monotonic()
    finished = _run_until_done(engine, deadline_s=20.0)
    killer.join()
    assert time.monotonic() - killed_at < 10.0
    assert sorted(finished) == ["0", "1", "2", "3"]
    for out in finished.values():
        assert out.outputs[0].finish_reason == "error"
        assert "worker pp_rank=1 tp_rank=1" in out.error and "died" in out.error
    with pytest.raises(EngineDeadError, match="replica group has failed"):
        engine.add_request("late", "hello")
    engine.pool.check_all_free()
    llm.shutdown()
    # Nothing of the failed group is left: its workers, placement group, and the driver
    # proxy actor its compiled graph made (which tracebacks would otherwise keep alive).
    assert shared_ray.leftovers_after(15) == []

    # Rebuilt in the same process, the group serves correctly again.
    rebuilt = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = rebuilt.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, 8)
        rebuilt.engine.pool.check_all_free()
    finally:
        rebuilt.shutdown()


def test_worker_that_raises_fails_the_group(ray_local) -> None:
    import ray

    model = tiny_model("llama")
    llm = LLM(model, tensor_parallel_size=2)
    try:
        engine = llm.engine
        engine.add_request("a", {"prompt_token_ids": [11, 12, 13]}, LONG)
        engine.step()

        def inject(worker) -> None:
            def boom(*args, **kwargs):
                raise RuntimeError("injected failure")
            worker.runner.execute_batch = boom

        ray.get(engine.executor.workers[1].__ray_call__.remote(inject))
        start = time.monotonic()
        finished = _run_until_done(engine, deadline_s=20.0)
        assert time.monotonic() - start < 10.0
        out = finished["a"]
        assert out.outputs[0].finish_reason == "error"
        assert "injected failure" in out.error and "tp_rank=1" in out.error
        with pytest.raises(EngineDeadError):
            engine.step()
        assert engine.executor.workers == []  # the group was torn down at once
        engine.pool.check_all_free()
    finally:
        llm.shutdown()


def test_a_worker_killed_before_the_first_step_fails_the_group_without_aborting_the_process(tmp_path) -> None:
    """Ray aborts a process that tears down a compiled graph none of whose channels was ever
    used (a reader registration fails a check): the executor runs one empty step at start.
    In a subprocess, so a regression fails this test instead of killing the test run. The
    graph is asked for: a CPU group makes plain actor calls by default."""
    import subprocess
    import sys

    script = f"""
import os, signal, time, ray
from tandem.cluster.local_ray import start_local_ray
start_local_ray(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
from tandem.workers.config import EngineConfig
from tandem.workers.engine.builder import build_engine
for i in range(2):
    engine = build_engine(EngineConfig.from_options(model={tiny_model("llama")!r}, tensor_parallel_size=2,
                                                    num_kv_blocks=32, compiled_graph=True), show_progress=False)
    assert engine.executor._dag is not None
    os.kill(engine.executor.worker_info[0]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    dead = engine.executor.probe_workers().dead
    engine.executor.fail("killed")
    engine.shutdown()
    print("round", i, dead, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [line for line in done.stdout.splitlines() if line.startswith("round ")]  # not Ray's own lines
    assert rounds == [f"round {i} ['pp_rank=0 tp_rank=0']" for i in range(2)]
