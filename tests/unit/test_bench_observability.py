"""`tandem bench observability`'s parts: CPU time of a process tree, the tracing environment
of a run, and the rounds' ratios (runs stubbed; the real servers run in tests/bench)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tandem.bench import observability_cost as obs
from tandem.bench.observability_cost import ObservabilityCostConfig, tree_cpu_seconds
from tandem.bench.workload import WorkloadSpec

SPIN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"


def test_a_process_tree_counts_its_childrens_cpu() -> None:
    # A child that burns 0.6 s of CPU, then sleeps: its time is in the tree, a stranger's is not.
    child = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_seconds(os.getpid()).get(child.pid, 0.0) < 0.6:
            assert time.monotonic() < deadline, "the child's CPU time never showed"
            time.sleep(0.1)
        tree = tree_cpu_seconds(os.getpid())
        assert os.getpid() in tree and child.pid in tree and 1 not in tree
        assert tree[child.pid] == pytest.approx(0.6, abs=0.15)
    finally:
        child.kill()
        child.wait()


def test_cpu_used_counts_new_processes_whole_and_old_ones_by_their_increase() -> None:
    assert obs._cpu_used({1: 2.0, 2: 5.0}, {1: 2.5, 3: 0.25}) == 0.75


def test_the_tracing_environment_is_set_for_a_run_and_restored_after(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.delenv("TANDEM_TRACES_FILE", raising=False)
    with obs._tracing_environment(str(tmp_path / "spans.jsonl")):
        assert (os.environ["OTEL_TRACES_EXPORTER"], os.environ["TANDEM_TRACES_FILE"]) == (
            "console", str(tmp_path / "spans.jsonl"))
    assert os.environ["OTEL_TRACES_EXPORTER"] == "otlp" and "TANDEM_TRACES_FILE" not in os.environ
    with obs._tracing_environment(None):
        assert "OTEL_TRACES_EXPORTER" not in os.environ  # off: none of the variables
    assert os.environ["OTEL_TRACES_EXPORTER"] == "otlp"


def test_rounds_alternate_and_the_ratios_are_medians_of_pairs(monkeypatch) -> None:
    runs = []
    # (output tok/s, CPU s per token) of each run in order: round 0 off then on, round 1 on then off, ...
    results = iter([(100.0, 0.010), (98.0, 0.0102), (90.0, 0.011), (100.0, 0.010), (50.0, 0.02), (49.0, 0.0204)])

    def one_run(cfg, local_app, model, engine_options, on, traces, warmup, passes, telemetry_cost=None):
        runs.append((on, telemetry_cost is not None))
        if traces is not None:  # as the servers' exporters would: 6 spans per request sent
            with open(traces, "w") as f:
                f.write("{}\n" * 6 * (len(warmup) + sum(len(p) for p in passes)))
        tok_s, cpu = next(results)
        share = {"telemetry_cpu_share": 0.001 if tok_s > 95 else 0.003} if telemetry_cost else {}
        return {"output_tok_s": tok_s, "cpu_s_per_token": cpu, **share}

    monkeypatch.setattr(obs, "_one_run", one_run)
    cfg = ObservabilityCostConfig(rounds=3, repeats=2, spec=WorkloadSpec(num_requests=3, prompt_len=(4, 8),
                                                                           output_len=(2, 3), seed=0))
    fig = obs.run_observability_cost(cfg, lambda options: None, model="m", vocab_size=100, show_progress=False,
                                     telemetry_cost=dict)
    # The code's own cost is measured in the "on" runs only.
    assert runs == [(False, False), (True, True), (True, True), (False, False), (False, False), (True, True)]
    assert fig["observability_throughput_ratio"] == pytest.approx(0.98)  # of 0.98, 0.90, 0.98
    assert fig["observability_throughput_ratio_min"] == pytest.approx(0.90)
    assert fig["observability_cpu_ratio"] == pytest.approx(1.02)  # of 1.02, 1.10, 1.02
    assert fig["spans_per_request"] == 6.0
    assert fig["round1_on_output_tok_s"] == 90.0 and fig["round1_off_output_tok_s"] == 100.0
    assert fig["telemetry_cpu_share"] == 0.003  # of 0.001, 0.003, 0.003


def test_the_telemetry_share_counts_requests_and_one_report_per_second() -> None:
    cost = {"telemetry_cpu_s_per_request": 0.002, "telemetry_cpu_s_per_report": 0.001}
    # 100 requests (0.2 s) and 20 reports (0.02 s) over 44 s of CPU.
    assert obs.telemetry_share(cost, num_requests=100, seconds=20.0, cpu_s=44.0) == pytest.approx(0.005)
