"""OpenTelemetry traces of requests: one trace per request, across the Ray processes serving it.

Off by default. On when `OTEL_TRACES_EXPORTER` names an exporter (and `OTEL_SDK_DISABLED` is
not true): `otlp` (needs `opentelemetry-exporter-otlp`; `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`
grpc or http/protobuf, the endpoint from `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`) or `console`
(one JSON line per span on stdout, or appended to the file `TANDEM_TRACES_FILE`). The rest is
the SDK's own reading of the standard variables: `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*` for batching. Ray
workers inherit the variables of the process that started Ray.

    ingress span (HTTP "POST /v1/completions", gRPC "tandem.v1.Tandem/Generate"; SERVER)
      parent: the client's W3C `traceparent` header / metadata, when sent
      ├── route            the request router's pick: group, decision, prefix match, load
      └── group_request    in the group: arrival to finish; events first_token, finish
            ├── queue      arrival to first scheduled
            ├── prefill    first scheduled to first token (chunks)
            └── decode     first token to last token

Spans cross process boundaries explicitly: the ingress puts a W3C carrier (a small dict)
into the group request (`CARRIER_KEY`); the router and the group start their spans from it.
The group's spans are made when the request finishes, from the engine's timestamps
(`RequestMetrics`), so nothing on the step path knows about tracing. Attribute names follow
the OpenTelemetry GenAI conventions where one exists (`gen_ai.*`), `tandem.*` otherwise.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tandem.workers.core.stats import RequestMetrics, wall_time

logger = logging.getLogger(__name__)

CARRIER_KEY = "trace_context"  # the group request's field holding the W3C carrier
REQUEST_ID_HEADER = "x-request-id"

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


# ---- the ingress span -------------------------------------------------------------------------------
@dataclass
class _Usage:
    input_tokens: int = 0
    output_tokens: int = 0


_usage: contextvars.ContextVar[_Usage | None] = contextvars.ContextVar("tandem_usage", default=None)


@contextmanager
def ingress_span(name: str, headers: Iterable[tuple[str, Any]] | Mapping[str, Any] | None,
                 attributes: dict[str, Any]) -> Iterator[Any]:
    """A SERVER span, child of the client's `traceparent` if it sent one, current for the
    block (so `inject` carries it into the group requests); yields the span or None."""
    tr = tracer()
    if tr is None:
        yield None
        return
    from opentelemetry import trace

    usage = _Usage()
    token = _usage.set(usage)
    try:
        with tr.start_as_current_span(name, context=extract(headers), kind=trace.SpanKind.SERVER,
                                      attributes=attributes) as span:
            try:
                yield span
            finally:
                span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
    finally:
        _usage.reset(token)


def note_group_request(model: str, sampling: dict[str, Any]) -> None:
    """The ingress span's request attributes (from the first group request it sends)."""
    if tracer() is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.request.model", model)
    for key, attr in (("max_tokens", "gen_ai.request.max_tokens"), ("temperature", "gen_ai.request.temperature"),
                      ("top_p", "gen_ai.request.top_p"), ("top_k", "gen_ai.request.top_k"),
                      ("seed", "gen_ai.request.seed")):
        if sampling.get(key) is not None:
            span.set_attribute(attr, sampling[key])


def note_usage(num_prompt_tokens: int, num_output_tokens: int) -> None:
    """Add a finished group request's tokens to the ingress span's usage."""
    usage = _usage.get()
    if usage is not None:
        usage.input_tokens += num_prompt_tokens
        usage.output_tokens += num_output_tokens


def serve_request_id() -> str | None:
    """Serve's id of the request being served here (the client's `x-request-id` when sent)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # noqa: BLE001 - outside a Serve request
        return None


class TracingMiddleware:
    """ASGI middleware of the HTTP ingress: each request's span (not /health), open until the
    response's last byte, so a streamed response is timed whole."""

    _OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat"}

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or path == "/health" or tracer() is None:
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())]
        method = scope.get("method", "")
        attrs = {"http.request.method": method, "url.path": path, "gen_ai.request.id": serve_request_id() or "",
                 "gen_ai.operation.name": self._OPERATIONS.get(path, "other")}
        with ingress_span(f"{method} {path}", headers, attrs) as span:
            async def send_status(message: dict) -> None:
                if message.get("type") == "http.response.start":
                    span.set_attribute("http.response.status_code", message.get("status", 0))
                await send(message)

            await self.app(scope, receive, send_status)


def traced_rpc(method: str) -> Callable[[Callable], Callable]:
    """Decorate a gRPC method of the ingress: its span (parent: the client's `traceparent`
    metadata) and the request id as `x-request-id` trailing metadata."""

    def decorate(fn: Callable) -> Callable:
        name = f"tandem.v1.Tandem/{method}"

        def start(grpc_context: Any) -> tuple[Any, dict[str, Any]]:
            request_id = serve_request_id()
            if request_id:
                grpc_context.set_trailing_metadata([(REQUEST_ID_HEADER, request_id)])
            attrs = {"rpc.system": "grpc", "rpc.service": "tandem.v1.Tandem", "rpc.method": method,
                     "gen_ai.operation.name": "text_completion", "gen_ai.request.id": request_id or ""}
            return ingress_span(name, grpc_context.invocation_metadata(), attrs), attrs

        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def stream(self: Any, request: Any, grpc_context: Any) -> Any:
                span_cm, _ = start(grpc_context)
                with span_cm:
                    async for message in fn(self, request, grpc_context):
                        yield message
            return stream

        @functools.wraps(fn)
        async def unary(self: Any, request: Any, grpc_context: Any) -> Any:
            span_cm, _ = start(grpc_context)
            with span_cm:
                return await fn(self, request, grpc_context)
        return unary

    return decorate


# ---- the router's and the group's spans -------------------------------------------------------------
def record_route(carrier: dict[str, str] | None, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
    """The routing decision, as a span under the ingress span."""
    tr = tracer()
    if tr is None or not carrier:
        return
    span = tr.start_span("route", context=extract(carrier), start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)


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
