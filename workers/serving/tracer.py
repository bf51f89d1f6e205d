"""This process's OpenTelemetry tracer, the W3C carrier that takes a trace across processes,
and a replica group's spans. The ingress's spans are router/tracing.py's, which says how a
request's trace is laid out.

Off by default. On when `OTEL_TRACES_EXPORTER` names an exporter (and `OTEL_SDK_DISABLED` is
not true): `otlp` (needs `opentelemetry-exporter-otlp`; `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`
grpc or http/protobuf, the endpoint from `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`) or `console`
(one JSON line per span on stdout, or appended to the file `TANDEM_TRACES_FILE`). The rest is
the SDK's own reading of the standard variables: `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*` for batching. Ray
workers inherit the variables of the process that started Ray.

The group's spans are made when a request finishes, from the engine's timestamps
(`RequestMetrics`), so nothing on the step path knows about tracing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.workers.core.stats import RequestMetrics, wall_time

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_tracer: Any = None
_provider: Any = None
_configured = False


def configure(exporter: Any | None = None) -> Any:
    """Set this process's tracer: with `exporter` (a SpanExporter, for tests) or from the
    environment. Returns the tracer, or None when tracing is off."""
    global _tracer, _provider, _configured
    with _lock:
        _provider = _make_provider(exporter)
        _tracer = _provider.get_tracer("tandem") if _provider is not None else None
        _configured = True
        return _tracer


def force_flush(timeout_s: float = 10.0) -> None:
    """Export the spans still batched in this process."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def flush_on_stop(timeout_s: float = 5.0) -> None:
    """`force_flush` for a finalizer (Serve calls a replica's `__del__` on a graceful stop):
    on a thread of its own, waited for at most `timeout_s`.

    A finalizer also runs when garbage collection finds its object, and that can happen in
    the middle of an export on this very thread (the exporter serialises spans), which holds
    the batch processor's lock until the export returns. The lock is not reentrant: a flush
    on this thread would wait for itself forever. On its own thread it waits for the export
    to end, or this returns after `timeout_s` and it flushes when the lock is free.
    """
    provider = _provider
    if provider is None:
        return
    flusher = threading.Thread(target=provider.force_flush, args=(int(timeout_s * 1000),),
                               name="tandem-trace-flush", daemon=True)
    flusher.start()
    flusher.join(timeout_s)


def tracer() -> Any:
    """This process's tracer (configured from the environment on first use), or None."""
    if not _configured:
        configure()
    return _tracer


def _make_provider(exporter: Any | None) -> Any:
    if exporter is None:
        names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
        if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not names or names == ["none"]:
            return None
        exporters = [e for e in (_exporter(name) for name in names) if e is not None]
        if not exporters:
            return None
    else:
        exporters = [exporter]
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # A provider of our own, not the global one: Serve's tracing may set that.
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tandem")})
    provider = TracerProvider(resource=resource)
    for exp in exporters:
        provider.add_span_processor(BatchSpanProcessor(exp))
    return provider


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        path = os.environ.get("TANDEM_TRACES_FILE")
        out = open(path, "a", buffering=1) if path else sys.stdout  # noqa: SIM115 - lives with the process
        return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    if name == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                  os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            logger.warning("OTEL_TRACES_EXPORTER=otlp needs `pip install opentelemetry-exporter-otlp`: "
                           "no traces exported")
            return None
        return OTLPSpanExporter()
    logger.warning("OTEL_TRACES_EXPORTER: %r is not supported here (otlp, console, none)", name)
    return None


# ---- context across processes ---------------------------------------------------------------------
def _propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def extract(pairs: Iterable[tuple[str, Any]] | Mapping[str, Any] | None) -> Any:
    """An OpenTelemetry Context from W3C headers / gRPC metadata / a carrier dict."""
    items = pairs.items() if isinstance(pairs, Mapping) else (pairs or ())
    carrier = {str(k).lower(): v.decode() if isinstance(v, bytes) else str(v) for k, v in items}
    return _propagator().extract(carrier)


def inject() -> dict[str, str] | None:
    """The current span as a W3C carrier for a group request; None when tracing is off."""
    if tracer() is None:
        return None
    carrier: dict[str, str] = {}
    _propagator().inject(carrier)
    return carrier or None


# ---- a group's spans -----------------------------------------------------------------------------------
def _to_ns(offset_s: float) -> Callable[[float], int]:
    """monotonic seconds -> wall-clock ns, with one offset (equal readings, equal times)."""
    return lambda monotonic_s: int((monotonic_s + offset_s) * 1e9)


def record_group_spans(carrier: dict[str, str] | None, metrics: RequestMetrics, *, group_id: str, model: str,
                       request_id: str) -> None:
    """A finished request's time in its group, from the engine's timestamps."""
    tr = tracer()
    if tr is None or not carrier:
        return
    from opentelemetry import trace

    attrs: dict[str, Any] = {
        "gen_ai.request.model": model, "gen_ai.response.id": request_id,
        "gen_ai.response.finish_reasons": [metrics.finish_reason],
        "gen_ai.usage.input_tokens": metrics.num_prompt_tokens,
        "gen_ai.usage.output_tokens": metrics.num_generation_tokens,
        "tandem.replica_group": group_id, "tandem.num_cached_tokens": metrics.num_cached_tokens,
        "tandem.num_preemptions": metrics.num_preemptions,
    }
    if metrics.num_draft_tokens:
        attrs.update({"tandem.spec.num_draft_tokens": metrics.num_draft_tokens,
                      "tandem.spec.num_accepted_tokens": metrics.num_accepted_tokens,
                      "tandem.spec.acceptance_rate": metrics.num_accepted_tokens / metrics.num_draft_tokens})
    _ns = _to_ns(wall_time(0.0))
    root = tr.start_span("group_request", context=extract(carrier), start_time=_ns(metrics.arrival_time),
                         attributes=attrs)
    inside = trace.set_span_in_context(root)
    phases = (("queue", metrics.arrival_time, metrics.first_scheduled_time, {}),
              ("prefill", metrics.first_scheduled_time, metrics.first_token_time,
               {"tandem.prefill.num_chunks": metrics.num_prefill_chunks}),
              ("decode", metrics.first_token_time, metrics.last_token_time,
               {"gen_ai.usage.output_tokens": metrics.num_generation_tokens}))
    for name, start, end, phase_attrs in phases:
        if start and end:
            span = tr.start_span(name, context=inside, start_time=_ns(start), attributes=phase_attrs)
            if name == "decode":
                span.add_event("first_token", timestamp=_ns(start))
            span.end(end_time=_ns(end))
    if metrics.first_token_time:
        root.add_event("first_token", timestamp=_ns(metrics.first_token_time))
    root.add_event("finish", {"gen_ai.response.finish_reason": metrics.finish_reason},
                   timestamp=_ns(metrics.finished_time))
    root.end(end_time=_ns(metrics.finished_time))
