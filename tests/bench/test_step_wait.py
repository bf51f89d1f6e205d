"""`python -m tandem.bench.step_wait`: the group engine thread's CPU a streamed token, the
simulated device's wait slept or spun."""

from __future__ import annotations

import json
import time

from tandem.bench import step_wait
from tandem.bench.workload import BenchRequest
from tandem.workers.core.output_pace import OutputPace
from tandem.workers.llm import LLM


def test_a_spin_wait_holds_its_time_and_counts_it():
    spin = step_wait.SpinWait()
    start = time.perf_counter()
    spin(0.005)
    spin(0.0)
    assert time.perf_counter() - start >= 0.005
    assert 0.005 <= spin.spun_s < 1.0


def test_every_request_streams_all_its_tokens_and_the_device_wait_is_restored(llama_dir):
    llm = LLM(model=llama_dir, simulated_step_ms=(0.2, 0.0))
    try:
        requests = [BenchRequest(prompt, 5) for prompt in ([5, 6, 7], [8, 9, 10, 11], [12, 13])]
        assert step_wait.stream_all(llm.engine, requests, 2, OutputPace()) == 15
        sleep = llm.engine.executor.wait
        spun = step_wait.measure(llm, requests, 2, 0.0, "spin")
        slept = step_wait.measure(llm, requests, 2, 1000.0, "sleep")
        assert llm.engine.executor.wait is sleep
        assert spun["spun_s"] > 0.0 and slept["spun_s"] == 0.0
        assert spun["host_us_per_token"] > 0.0 and slept["host_us_per_token"] > 0.0
        assert not llm.engine.has_unfinished_requests()
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()


def test_main_writes_both_waits_and_their_ratio(llama_dir, tmp_path):
    out = tmp_path / "step_wait.json"
    step_wait.main(["--model", llama_dir, "--simulated-step-ms", "0.2,0", "--num-requests", "3",
                    "--concurrency", "2", "--output-len", "4", "--num-scheduler-steps", "4", "--repeats", "1",
                    "--output-json", str(out)])
    figures = json.loads(out.read_text())
    assert (figures["num_requests"], figures["concurrency"], figures["output_len"], figures["repeats"],
            figures["num_scheduler_steps"]) == (3, 2, 4, 1, 4)
    assert figures["simulated_step_ms"] == "0.2,0.0"
    for name in ("sleep_host_us_per_token", "spin_host_us_per_token", "sleep_output_tok_s", "spin_output_tok_s",
                 "sleep_over_spin"):
        assert figures[name] > 0.0
