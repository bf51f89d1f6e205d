"""`tandem bench observability`: what metrics and tracing cost a server's throughput.

Rounds of two fresh servers each (Ray, Serve, one group of the model; nothing of one run is
left when the next starts), one with metrics and tracing off and one with both on, the order
alternating from round to round so that a drift of the machine falls on both alike.

    on    every group and the router export Prometheus metrics (every `metrics_interval_s`),
          and every request's spans go through OpenTelemetry's SDK (batching, serialising) to
          the console exporter, appended to a file (`OTEL_TRACES_EXPORTER=console`,
          `TANDEM_TRACES_FILE`)
    off   `metrics: false`, no `OTEL_*` variables; the engine's own counting stays (it has no
          switch: it is a few integer sums per step)

A run: one warm-up, then `repeats` passes over the request set at a fixed number in flight,
streamed (as `tandem bench serve` sends them), the passes' tokens over their time.

    observability_throughput_ratio   median over rounds of on / off output tok/s
    observability_cpu_ratio          median over rounds of on / off CPU seconds per output token,
                                     counted over this process and all its descendants (Ray,
                                     Serve's proxy, the ingress, the group): the cost itself,
                                     which a CPU shared by model and host turns into throughput
    spans_per_request                spans written per request in the "on" runs (the proof that
                                     tracing ran; 6 per request: ingress, route, group_request,
                                     queue, prefill, decode)
    telemetry_cpu_share              the metrics and tracing code's own CPU (router/telemetry_cost.py:
                                     that code run in a loop in this process, per request and per
                                     reporter interval) over the "on" run's CPU, for the requests and
                                     seconds of the run: what the +-6% noise of the comparison hides.
                                     On a CPU-bound server it bounds the throughput cost (target <= 0.02)
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from tandem.bench.load_generator import LoadLevel, run_level
from tandem.bench.report import log_progress
from tandem.bench.serve import SERVE_QUICK, level_requests
from tandem.bench.server import SERVED_MODEL_NAME, AppBuilder, bench_server
from tandem.bench.workload import BenchRequest, WorkloadSpec

TRACING_VARIABLES = ("OTEL_TRACES_EXPORTER", "TANDEM_TRACES_FILE", "OTEL_SDK_DISABLED")
# () -> {"telemetry_cpu_s_per_request", "telemetry_cpu_s_per_report"} (router/telemetry_cost.py,
# handed in through RouterHooks; needs this process connected to Ray)
TelemetryCost = Callable[[], dict[str, float]]
METRICS_INTERVAL_S = 1.0  # the serving default: one reporter interval per second


@dataclass(frozen=True)
class ObservabilityCostConfig:
    rounds: int = 4  # pairs of runs (off, on), order alternating
    repeats: int = 3  # passes over the request set per run
    concurrency: int = 8
    spec: WorkloadSpec = replace(SERVE_QUICK, num_requests=32)


OBS_QUICK = ObservabilityCostConfig(rounds=1, repeats=1, spec=replace(SERVE_QUICK, num_requests=8))


def run_observability_cost(cfg: ObservabilityCostConfig, local_app: AppBuilder, *, model: str,
                           engine_options: dict[str, Any] | None = None, vocab_size: int,
                           telemetry_cost: TelemetryCost | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Figures of every run, then the medians named in the module docstring."""
    figures: dict[str, Any] = {"rounds": cfg.rounds, "repeats": cfg.repeats, "concurrency": cfg.concurrency,
                               "num_requests": cfg.spec.num_requests, "model": model}
    passes = [level_requests(cfg.spec, vocab_size, i) for i in range(cfg.repeats)]
    warmup = [BenchRequest(r.prompt_token_ids[:8], 4) for r in level_requests(cfg.spec, vocab_size, -1)[:2]]
    ratios: dict[str, list[float]] = {"throughput": [], "cpu": []}
    spans = []
    with tempfile.TemporaryDirectory(prefix="tandem-obs-") as tmp:
        for r in range(cfg.rounds):
            runs = {}
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                name = "on" if on else "off"
                log_progress("observability", show_progress, f"round {r + 1}/{cfg.rounds}: metrics and tracing {name}")
                traces = os.path.join(tmp, f"spans-{r}.jsonl") if on else None
                runs[name] = _one_run(cfg, local_app, model, engine_options or {}, on, traces, warmup, passes,
                                      telemetry_cost if on else None)
                for key, value in runs[name].items():
                    figures[f"round{r}_{name}_{key}"] = value
                if traces is not None:
                    spans.append(_count_lines(traces) / (len(warmup) + sum(len(p) for p in passes)))
            ratios["throughput"].append(runs["on"]["output_tok_s"] / runs["off"]["output_tok_s"])
            ratios["cpu"].append(runs["on"]["cpu_s_per_token"] / runs["off"]["cpu_s_per_token"])
    for kind, values in ratios.items():
        figures[f"observability_{kind}_ratio"] = statistics.median(values)
        figures[f"observability_{kind}_ratio_min"] = min(values)
        figures[f"observability_{kind}_ratio_max"] = max(values)
    figures["spans_per_request"] = statistics.median(spans)
    for key in ("telemetry_cpu_share", "telemetry_cpu_s_per_request", "telemetry_cpu_s_per_report"):
        values = [figures[f"round{r}_on_{key}"] for r in range(cfg.rounds) if f"round{r}_on_{key}" in figures]
        if values:
            figures[key] = statistics.median(values)
    return figures


def _one_run(cfg: ObservabilityCostConfig, local_app: AppBuilder, model: str, engine_options: dict[str, Any],
             on: bool, traces: str | None, warmup: list[BenchRequest], passes: list[list[BenchRequest]],
             telemetry_cost: TelemetryCost | None = None) -> dict[str, float]:
    options = {**engine_options, "model": model, "metrics": on}
    level = LoadLevel(concurrency=cfg.concurrency)
    with _tracing_environment(traces), bench_server(local_app, {"": options}, num_cpus=(os.cpu_count() or 1) + 4) \
            as urls:
        url = urls[""]
        asyncio.run(run_level(url, warmup, LoadLevel(rate=math.inf), model=SERVED_MODEL_NAME))
        tokens, seconds, failed = 0, 0.0, 0
        cpu_before = tree_cpu_seconds(os.getpid())
        for requests in passes:
            records, duration = asyncio.run(run_level(url, requests, level, model=SERVED_MODEL_NAME))
            tokens += sum(rec.num_output_tokens for rec in records if rec.ok)
            failed += sum(1 for rec in records if not rec.ok)
            seconds += duration
        cpu = _cpu_used(cpu_before, tree_cpu_seconds(os.getpid()))
        cost = telemetry_cost() if telemetry_cost is not None else {}  # Ray is still up
    if failed:
        raise RuntimeError(f"{failed} requests failed in a {'metrics and tracing on' if on else 'off'} run")
    figures = {"output_tok_s": tokens / seconds, "cpu_s_per_token": cpu / tokens, "cpu_cores_busy": cpu / seconds,
               "load_average_1m": os.getloadavg()[0], **cost}
    if cost:
        figures["telemetry_cpu_share"] = telemetry_share(cost, sum(len(p) for p in passes), seconds, cpu)
    return figures


def telemetry_share(cost: dict[str, float], num_requests: int, seconds: float, cpu_s: float) -> float:
    """The telemetry code's CPU for `num_requests` served in `seconds` (one report per metrics
    interval), over the run's `cpu_s`."""
    spent = (cost["telemetry_cpu_s_per_request"] * num_requests
             + cost["telemetry_cpu_s_per_report"] * seconds / METRICS_INTERVAL_S)
    return spent / cpu_s


@contextmanager
def _tracing_environment(traces_file: str | None) -> Iterator[None]:
    """Tracing through the console exporter into `traces_file` (None: off). Ray's processes
    inherit the variables of the process that starts Ray, which `bench_server` does next."""
    saved = {name: os.environ.pop(name) for name in TRACING_VARIABLES if name in os.environ}
    if traces_file is not None:
        os.environ.update(OTEL_TRACES_EXPORTER="console", TANDEM_TRACES_FILE=traces_file)
    try:
        yield
    finally:
        for name in TRACING_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(saved)


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# ---- CPU time of a process tree (Linux /proc) ------------------------------------------------------
def tree_cpu_seconds(root: int) -> dict[int, float]:
    """{pid: user + system CPU seconds} of `root` and every process descended from it."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        pid = int(entry)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in times:
            tree[pid] = times[pid]
        stack.extend(children.get(pid, ()))
    return tree


def _cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings (a process new since `before` counts whole)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def table_rows(figures: dict[str, Any]) -> list[tuple[str, Any, str]]:
    rows = [(name, figures[name], "") for name in (
        "observability_throughput_ratio", "observability_throughput_ratio_min", "observability_throughput_ratio_max",
        "observability_cpu_ratio", "observability_cpu_ratio_min", "observability_cpu_ratio_max",
        "spans_per_request") if name in figures]
    rows += [(name, figures[name], unit) for name, unit in (
        ("telemetry_cpu_share", ""), ("telemetry_cpu_s_per_request", "s"), ("telemetry_cpu_s_per_report", "s"))
        if name in figures]
    for r in range(figures["rounds"]):
        for name in ("off", "on"):
            rows.append((f"round{r}_{name}_output_tok_s", figures[f"round{r}_{name}_output_tok_s"], "tok/s"))
            rows.append((f"round{r}_{name}_cpu_s_per_token", figures[f"round{r}_{name}_cpu_s_per_token"], "s"))
    return rows + [("wall_s", figures.get("wall_s"), "s")]
