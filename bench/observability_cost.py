"""`tandem bench observability`: what metrics and tracing cost a server's throughput.

One Ray and Serve on this machine, two applications of the same model side by side (one
group each), identical but for observability:

    on    its groups and router export Prometheus metrics (every `metrics_interval_s`), and
          every request's spans go through OpenTelemetry's SDK (batching, serialising) to the
          console exporter, appended to a file (`env_vars`: `OTEL_TRACES_EXPORTER=console`,
          `TANDEM_TRACES_FILE`)
    off   `metrics: false`, no `OTEL_*` variables; the engine's own counting stays (it has no
          switch: a few integer sums per step)

Rounds: in each, one pass of a fresh request set through each application, streamed at a
fixed number in flight (as `tandem bench serve` sends them), the order alternating from
round to round. Interleaving passes of a few seconds inside one cluster puts both
configurations through the same drift of a shared machine, which between fresh servers
minutes apart reaches 10% here; the idle application costs both alike.

    observability_throughput_ratio   median over rounds of on / off output tok/s (target >= 0.98)
    observability_cpu_ratio          median over rounds of on / off CPU seconds per output token,
                                     counted over this process and all its descendants (Ray,
                                     Serve's proxy, both applications)
    spans_per_request                spans written per request sent to "on", health checks'
                                     left out (the proof that tracing ran; 6: ingress, route,
                                     group_request, queue, prefill, decode)
    telemetry_cpu_share              the metrics and tracing code's own CPU (router/telemetry_cost.py:
                                     that code run in a loop in this process, per request and per
                                     reporter interval), for the requests and seconds of the "on"
                                     passes, over those passes' CPU. On a CPU-bound server it
                                     bounds the throughput cost (target <= 0.02); it is what the
                                     comparison's noise cannot hide
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from tandem.bench.load_generator import LoadLevel, run_level
from tandem.bench.process_cpu import cpu_used, tree_cpu_seconds
from tandem.bench.report import log_progress
from tandem.bench.serve import SERVE_QUICK, level_requests
from tandem.bench.server import SERVED_MODEL_NAME, AppBuilder, bench_server
from tandem.bench.workload import BenchRequest, WorkloadSpec

TRACING_VARIABLES = ("OTEL_TRACES_EXPORTER", "TANDEM_TRACES_FILE", "OTEL_SDK_DISABLED")
# () -> {"telemetry_cpu_s_per_request", "telemetry_cpu_s_per_report", ...} (router/telemetry_cost.py,
# handed in through RouterHooks; needs this process connected to Ray)
TelemetryCost = Callable[[], dict[str, float]]
METRICS_INTERVAL_S = 1.0  # the serving default: one reporter interval per second
CONFIGS = ("off", "on")
EXPORT_WAIT_S = 6.0  # OpenTelemetry's BatchSpanProcessor exports every 5 s


@dataclass(frozen=True)
class ObservabilityCostConfig:
    rounds: int = 12  # passes through each application, the order alternating
    concurrency: int = 8
    spec: WorkloadSpec = replace(SERVE_QUICK, num_requests=32)  # one pass


OBS_QUICK = ObservabilityCostConfig(rounds=2, spec=replace(SERVE_QUICK, num_requests=8))


@dataclass
class Pass:
    """One pass of a request set through one application."""

    output_tokens: int
    seconds: float
    cpu_s: float  # of the whole process tree
    failed: int


def run_observability_cost(cfg: ObservabilityCostConfig, local_app: AppBuilder, *, model: str,
                           engine_options: dict[str, Any] | None = None, vocab_size: int,
                           telemetry_cost: TelemetryCost | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Figures of every pass, then the medians named in the module docstring."""
    figures: dict[str, Any] = {"rounds": cfg.rounds, "concurrency": cfg.concurrency,
                               "num_requests": cfg.spec.num_requests, "model": model}
    warmup = [BenchRequest(r.prompt_token_ids[:8], 4) for r in level_requests(cfg.spec, vocab_size, -1)[:2]]
    passes: dict[str, list[Pass]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="tandem-obs-") as tmp:
        traces = os.path.join(tmp, "spans.jsonl")
        base = {**(engine_options or {}), "model": model}
        apps = {"off": {**base, "metrics": False},
                "on": {**base, "metrics": True,
                       "env_vars": {"OTEL_TRACES_EXPORTER": "console", "TANDEM_TRACES_FILE": traces}}}
        log_progress("observability", show_progress, "starting both applications")
        with _without_tracing_variables(), bench_server(local_app, apps, num_cpus=(os.cpu_count() or 1) + 4) as urls:
            for url in urls.values():
                _measure(url, warmup, LoadLevel(rate=math.inf))
            for r in range(cfg.rounds):
                requests = level_requests(cfg.spec, vocab_size, r)
                for name in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
                    log_progress("observability", show_progress, f"round {r + 1}/{cfg.rounds}: {name}")
                    passes[name].append(_measure(urls[name], requests, LoadLevel(concurrency=cfg.concurrency)))
            cost = telemetry_cost() if telemetry_cost is not None else {}  # Ray is still up
            # The last passes' spans wait up to the batch processor's delay (5 s) in the
            # replicas; a graceful stop flushes them too, but a stop may be cut short.
            time.sleep(EXPORT_WAIT_S)
        spans = _count_request_spans(traces)
    failed = sum(p.failed for runs in passes.values() for p in runs)
    if failed:
        raise RuntimeError(f"{failed} requests failed")
    figures.update(summarize(passes))
    figures["spans_per_request"] = spans / (len(warmup) + cfg.rounds * cfg.spec.num_requests)
    if cost:
        figures.update(cost)
        on = passes["on"]
        figures["telemetry_cpu_share"] = telemetry_share(cost, cfg.rounds * cfg.spec.num_requests,
                                                         sum(p.seconds for p in on), sum(p.cpu_s for p in on))
    return figures


def summarize(passes: dict[str, list[Pass]]) -> dict[str, float]:
    """Each pass's figures, and the medians, minima and maxima of the rounds' on / off ratios."""
    figures: dict[str, float] = {}
    for name, runs in passes.items():
        for r, p in enumerate(runs):
            figures[f"round{r}_{name}_output_tok_s"] = p.output_tokens / p.seconds
            figures[f"round{r}_{name}_cpu_s_per_token"] = p.cpu_s / p.output_tokens
    rounds = range(len(passes["on"]))
    ratios = {
        "throughput": [figures[f"round{r}_on_output_tok_s"] / figures[f"round{r}_off_output_tok_s"] for r in rounds],
        "cpu": [figures[f"round{r}_on_cpu_s_per_token"] / figures[f"round{r}_off_cpu_s_per_token"] for r in rounds],
    }
    for kind, values in ratios.items():
        figures[f"observability_{kind}_ratio"] = statistics.median(values)
        figures[f"observability_{kind}_ratio_min"] = min(values)
        figures[f"observability_{kind}_ratio_max"] = max(values)
    return figures


def telemetry_share(cost: dict[str, float], num_requests: int, seconds: float, cpu_s: float) -> float:
    """The telemetry code's CPU for `num_requests` served in `seconds` (one report per metrics
    interval), over the passes' `cpu_s`."""
    spent = (cost["telemetry_cpu_s_per_request"] * num_requests
             + cost["telemetry_cpu_s_per_report"] * seconds / METRICS_INTERVAL_S)
    return spent / cpu_s


def _measure(url: str, requests: list[BenchRequest], level: LoadLevel) -> Pass:
    before = tree_cpu_seconds(os.getpid())
    records, seconds = asyncio.run(run_level(url, requests, level, model=SERVED_MODEL_NAME))
    cpu = cpu_used(before, tree_cpu_seconds(os.getpid()))
    return Pass(sum(rec.num_output_tokens for rec in records if rec.ok), seconds, cpu,
                sum(1 for rec in records if not rec.ok))


@contextmanager
def _without_tracing_variables() -> Iterator[None]:
    """No tracing variables in this process for the block: Ray's processes inherit them, so
    only an application whose own `env_vars` say so traces. Restored after."""
    saved = {name: os.environ.pop(name) for name in TRACING_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _count_request_spans(path: str) -> int:
    """Spans in an exporter's JSON lines, but for the health checks' (`GET /health`: the
    server is polled until it is up, a varying number of times)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip() and not json.loads(line)["name"].startswith("GET "))


def table_rows(figures: dict[str, Any]) -> list[tuple[str, Any, str]]:
    rows = [(name, figures[name], unit) for name, unit in (
        ("observability_throughput_ratio", ""), ("observability_throughput_ratio_min", ""),
        ("observability_throughput_ratio_max", ""), ("observability_cpu_ratio", ""),
        ("observability_cpu_ratio_min", ""), ("observability_cpu_ratio_max", ""), ("spans_per_request", ""),
        ("telemetry_cpu_share", ""), ("telemetry_cpu_s_per_request", "s"), ("telemetry_cpu_s_per_report", "s"))
        if name in figures]
    for r in range(figures["rounds"]):
        for name in CONFIGS:
            rows.append((f"round{r}_{name}_output_tok_s", figures[f"round{r}_{name}_output_tok_s"], "tok/s"))
    return rows + [("wall_s", figures.get("wall_s"), "s")]
