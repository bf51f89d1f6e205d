"""`tandem bench observability`'s parts: the tracing environment of a run and the rounds'
ratios (runs stubbed; the real servers run in tests/bench; the process tree's CPU is
tests/bench/test_process_cpu.py's)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from tandem.bench import observability_cost as obs
from tandem.bench.observability_cost import ObservabilityCostConfig
from tandem.bench.workload import WorkloadSpec


def test_the_tracing_variables_are_cleared_for_a_run_and_restored_after(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.delenv("TANDEM_TRACES_FILE", raising=False)
    with obs._without_tracing_variables():
        assert "OTEL_TRACES_EXPORTER" not in os.environ  # off: none of the variables
    assert os.environ["OTEL_TRACES_EXPORTER"] == "otlp" and "TANDEM_TRACES_FILE" not in os.environ


def test_rounds_alternate_between_the_two_apps_and_the_ratios_are_medians(monkeypatch) -> None:
    served: list[tuple[str, int]] = []
    apps_started = {}

    @contextmanager
    def server(local_app, apps, num_cpus):
        apps_started.update(apps)
        assert "OTEL_TRACES_EXPORTER" not in os.environ  # only the "on" app traces, through its env_vars
        yield {"off": "off", "on": "on"}

    # (output tokens, CPU s) of each round's pass, by app: on is 2% slower in rounds 0 and 2, 10% in round 1.
    figures = {"off": [(100, 1.0), (100, 1.0), (50, 1.0)], "on": [(98, 1.0), (90, 1.0), (49, 1.0)]}

    def measure(url, requests, level):
        if url == "on":  # as the app's exporter would: 6 spans per request, the warm-up's too, and a health check
            with open(apps_started["on"]["env_vars"]["TANDEM_TRACES_FILE"], "a") as f:
                f.write('{"name": "POST /v1/completions"}\n' * 6 * len(requests) + '{"name": "GET /health"}\n')
        if level.concurrency is None:  # the warm-up
            return obs.Pass(8, 1.0, 1.0, 0)
        served.append((url, len(requests)))
        tokens, cpu = figures[url][sum(1 for u, _ in served if u == url) - 1]
        return obs.Pass(tokens, 1.0, cpu, 0)

    monkeypatch.setattr(obs, "bench_server", server)
    monkeypatch.setattr(obs, "_measure", measure)
    monkeypatch.setattr(obs, "EXPORT_WAIT_S", 0.0)
    cfg = ObservabilityCostConfig(rounds=3, spec=WorkloadSpec(num_requests=3, prompt_len=(4, 8), output_len=(2, 3),
                                                              seed=0))
    cost = {"telemetry_cpu_s_per_request": 0.01, "telemetry_cpu_s_per_report": 0.05}
    fig = obs.run_observability_cost(cfg, lambda options: None, model="m", vocab_size=100, show_progress=False,
                                     telemetry_cost=lambda: cost)
    assert [url for url, _ in served] == ["off", "on", "on", "off", "off", "on"]
    assert apps_started["off"]["metrics"] is False and "env_vars" not in apps_started["off"]
    assert apps_started["on"]["metrics"] is True
    assert apps_started["on"]["env_vars"]["OTEL_TRACES_EXPORTER"] == "console"
    assert fig["observability_throughput_ratio"] == pytest.approx(0.98)  # of 0.98, 0.90, 0.98
    assert fig["observability_throughput_ratio_min"] == pytest.approx(0.90)
    assert fig["observability_cpu_ratio"] == pytest.approx(100 / 98)  # CPU per token, on / off
    assert fig["spans_per_request"] == 6.0
    assert fig["round1_on_output_tok_s"] == 90.0 and fig["round1_off_output_tok_s"] == 100.0
    # 9 requests (0.09 s) and 3 reports (0.15 s) over the on passes' 3 s of CPU.
    assert fig["telemetry_cpu_share"] == pytest.approx(0.08)


def test_the_telemetry_share_counts_requests_and_one_report_per_second() -> None:
    cost = {"telemetry_cpu_s_per_request": 0.002, "telemetry_cpu_s_per_report": 0.001}
    # 100 requests (0.2 s) and 20 reports (0.02 s) over 44 s of CPU.
    assert obs.telemetry_share(cost, num_requests=100, seconds=20.0, cpu_s=44.0) == pytest.approx(0.005)
