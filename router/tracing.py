"""OpenTelemetry traces of requests at the ingress: one trace per request, across the Ray
processes serving it (the tracer and its configuration: workers/serving/tracer.py).

    ingress span ("text_completion tandem-demo", "chat tandem-demo"; SERVER)
      parent: the client's W3C `traceparent` header / metadata, when sent
      ├── route            the request router's pick: group, decision, prefix match, load
      └── group_request    in the group: arrival to finish; events first_token, finish
            ├── queue      arrival to first scheduled
            ├── prefill    first scheduled to first token (chunks)
            └── decode     first token to last token

Spans cross process boundaries explicitly: the ingress puts a W3C carrier (a small dict)
into the group request (`GroupRequest.trace_context`); the router and the group start
their spans from it. Attribute names follow the OpenTelemetry GenAI conventions where one
exists (`gen_ai.*`), `tandem.*` otherwise.

The ingress span is the request's GenAI inference span (semantic conventions 1.37+, the
server's side of the call): named `{gen_ai.operation.name} {gen_ai.request.model}` once the
first group request names the model (until then, and for a request refused before one, its
protocol's name: "POST /v1/completions", "tandem.v1.Tandem/Generate"), with
`gen_ai.provider.name` (the convention's successor of `gen_ai.system`), the request's
sampling settings and the usage of all its group requests. It is the only span of a
request with `gen_ai.operation.name`, so a GenAI-aware backend counts each request once.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tandem.workers.core.request import SamplingParams
from tandem.workers.serving.tracer import extract, tracer

REQUEST_ID_HEADER = "x-request-id"
# gen_ai.provider.name: none of the convention's well-known values (openai, aws.bedrock, ...)
# names a self-hosted server; the convention takes the instrumentation's own name then.
PROVIDER_NAME = "tandem"


# ---- the ingress span -------------------------------------------------------------------------------
@dataclass
class _Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)


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
                if usage.finish_reasons:
                    span.set_attribute("gen_ai.response.finish_reasons", usage.finish_reasons)
    finally:
        _usage.reset(token)


def note_group_request(model: str, params: SamplingParams, response_id: str | None = None) -> None:
    """The ingress span's request attributes and GenAI name (from the first group request it
    sends; a request of several prompts sends several, with the same model and settings).
    `response_id`: the id of the response the client gets (`gen_ai.response.id`)."""
    if tracer() is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.request.model", model)
    operation = span.attributes.get("gen_ai.operation.name")
    if operation:
        span.update_name(f"{operation} {model}")
    for key, attr in (("max_tokens", "gen_ai.request.max_tokens"), ("temperature", "gen_ai.request.temperature"),
                      ("top_p", "gen_ai.request.top_p"), ("top_k", "gen_ai.request.top_k"),
                      ("seed", "gen_ai.request.seed")):
        value = getattr(params, key)
        if value is not None and not (key == "top_k" and value == -1):
            span.set_attribute(attr, value)
    if params.n != 1:  # the convention sets it only then
        span.set_attribute("gen_ai.request.choice.count", params.n)
    if response_id is not None:
        span.set_attribute("gen_ai.response.id", response_id)


def note_usage(num_prompt_tokens: int, num_output_tokens: int, finish_reasons: Iterable[str | None] = ()) -> None:
    """Add a finished group request's tokens, and its sequences' finish reasons, to the
    ingress span's usage."""
    usage = _usage.get()
    if usage is not None:
        usage.input_tokens += num_prompt_tokens
        usage.output_tokens += num_output_tokens
        usage.finish_reasons.extend(reason for reason in finish_reasons if reason)


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
                 "gen_ai.operation.name": self._OPERATIONS.get(path, "other"), "gen_ai.provider.name": PROVIDER_NAME}
        with ingress_span(f"{method} {path}", headers, attrs) as span:
            async def send_status(message: dict) -> None:
                if message.get("type") == "http.response.start":
                    span.set_attribute("http.response.status_code", message.get("status", 0))
                await send(message)

            await self.app(scope, receive, send_status)


def traced_rpc(method: str, operation: str = "text_completion") -> Callable[[Callable], Callable]:
    """Decorate a gRPC method of the ingress: its span (parent: the client's `traceparent`
    metadata; `operation`: its gen_ai.operation.name) and the request id as `x-request-id`
    trailing metadata."""

    def decorate(fn: Callable) -> Callable:
        name = f"tandem.v1.Tandem/{method}"

        def start(grpc_context: Any) -> tuple[Any, dict[str, Any]]:
            request_id = serve_request_id()
            if request_id:
                grpc_context.set_trailing_metadata([(REQUEST_ID_HEADER, request_id)])
            attrs = {"rpc.system": "grpc", "rpc.service": "tandem.v1.Tandem", "rpc.method": method,
                     "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER_NAME,
                     "gen_ai.request.id": request_id or ""}
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


# ---- the router's span ------------------------------------------------------------------------------
def record_route(carrier: dict[str, str] | None, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
    """The routing decision, as a span under the ingress span."""
    tr = tracer()
    if tr is None or not carrier:
        return
    span = tr.start_span("route", context=extract(carrier), start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)
