"""The CPU that tandem's metrics and tracing code costs, measured on that code itself.

An end-to-end on/off comparison (`tandem bench observability`) carries the machine's noise:
on a shared 2-core machine, passes of one configuration differ by up to 11%, more than the 2%
budget being checked. This measures the added work directly instead: the functions a request
and the metrics reporter run when metrics and tracing are on, called here in a loop, their
CPU time per call. Nothing is stubbed: Ray's metrics (the process must be connected to Ray),
OpenTelemetry's SDK with its batch processor, and the console exporter writing JSON lines
to a file.

Per request (as in a served one):
    ingress   the SERVER span with its attributes, current while the group request is built
              (`ingress_span`, `inject`, `note_group_request`, `note_usage`)
    route     the router's span (`record_route`); its decision counter
    group     the request histograms, tandem's six and vLLM's nine (`GroupMetrics.observe_request`),
              and the group's four spans (`record_group_spans`)
    export    the spans serialised and written by the exporter (`force_flush`)
Per reporter interval:
    report    one `GroupMetrics.report` (counters, gauges, MBU/MFU, the interval's ITL
              observations: one per step, under tandem's name and vLLM's two)
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from tandem.router import tracing
from tandem.workers.core.request import SamplingParams
from tandem.workers.core.stats import RequestMetrics
from tandem.workers.device_peaks import DevicePeaks
from tandem.workers.serving import tracer
from tandem.workers.serving.group_metrics import FINISH_REASONS, SNAPSHOT_COUNTERS, SNAPSHOT_GAUGES, GroupMetrics

TAGS = {"application": "telemetry-cost", "model": "m", "replica_group": "g"}
SAMPLING = SamplingParams(max_tokens=32, temperature=0.0, top_p=1.0, seed=0)


def telemetry_cpu_cost(num_requests: int = 400, steps_per_report: int = 100) -> dict[str, float]:
    """{"telemetry_cpu_s_per_request", "telemetry_cpu_s_per_report"}: CPU seconds of this
    process per request, and per reporter interval holding `steps_per_report` steps; and
    "telemetry_spans_per_request", the spans the exporter wrote per request (6: what a
    served request makes)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    from ray.util.metrics import Counter

    fd, path = tempfile.mkstemp(prefix="tandem-telemetry-cost-", suffix=".jsonl")
    os.close(fd)
    out = open(path, "a", buffering=1)  # noqa: SIM115 - closed below, after the last flush
    tracer.configure(ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))
    try:
        metrics = GroupMetrics(TAGS)
        metrics.set_peaks(DevicePeaks(flops_per_s=1e12, bytes_per_s=1e11), 1)
        decisions = Counter("tandem_router_decisions", "Requests routed", tag_keys=("application", "decision"))
        decisions.set_default_tags({"application": TAGS["application"]})
        now = time.monotonic()
        finished = RequestMetrics(now, now + 0.01, now + 0.05, now + 0.5, now + 0.51, "length", 64, 32, 0, 1, 0)
        _one_request(metrics, decisions, finished)  # first calls build the SDK's and Ray's caches
        tracer.force_flush()
        warm_spans = _count_lines(path)
        start = time.process_time()
        for i in range(num_requests):
            _one_request(metrics, decisions, finished, f"req-{i}")
        tracer.force_flush()
        per_request = (time.process_time() - start) / num_requests
        spans = (_count_lines(path) - warm_spans) / num_requests
        reports = 20
        start = time.process_time()
        for i in range(1, reports + 1):
            metrics.report(_snapshot(i), [0.02] * steps_per_report, 0)
        per_report = (time.process_time() - start) / reports
    finally:
        tracer.configure()  # back to what the environment says
        out.close()
        os.unlink(path)
    return {"telemetry_cpu_s_per_request": per_request, "telemetry_cpu_s_per_report": per_report,
            "telemetry_spans_per_request": spans}


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _one_request(metrics: GroupMetrics, decisions: Any, finished: RequestMetrics, request_id: str = "warm") -> None:
    with tracing.ingress_span("POST /v1/completions", (), {
            "http.request.method": "POST", "url.path": "/v1/completions", "gen_ai.request.id": request_id,
            "gen_ai.operation.name": "text_completion"}) as span:
        span.set_attribute("http.response.status_code", 200)
        tracing.note_group_request("m", SAMPLING)
        carrier = tracer.inject()
        started = time.time_ns()
        decisions.inc(1, tags={"decision": "load"})
        tracing.record_route(carrier, started, time.time_ns(), {
            "tandem.route.replica_group": "g", "tandem.route.decision": "load",
            "tandem.route.prefix_cached_tokens": 0, "tandem.route.score": 1.0, "tandem.route.num_candidates": 2})
        metrics.observe_request(finished)
        tracer.record_group_spans(carrier, finished, group_id="g", model="m", request_id=request_id)
        tracing.note_usage(finished.num_prompt_tokens, finished.num_generation_tokens)


def _snapshot(i: int) -> dict[str, float]:
    """A metrics snapshot whose counters have all grown since the last one (every counter incs)."""
    keys = {key for _, key in SNAPSHOT_COUNTERS.values()} | {f"num_finished_{r}" for r in FINISH_REASONS}
    values = {key: float(100 * i) for key in keys}
    values.update({key: 0.5 for _, key in SNAPSHOT_GAUGES.values()})
    values.update(step_seconds=0.5 * i, bytes_read=1e9 * i, flops=1e12 * i)
    return values
