"""router/tracing.py and workers/serving/tracer.py in one process with an in-memory exporter:
the ingress span under the client's traceparent, the carrier a group request takes, and the route and group spans made
from it, all one connected trace."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.router import tracing
from tandem.workers.core.request import SamplingParams
from tandem.workers.core.stats import RequestMetrics
from tandem.workers.serving import tracer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer.configure(exporter)
    yield exporter
    tracer.configure(None)  # back to the environment's choice (off in tests)


def test_off_by_default_without_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracer.configure() is None
    assert tracer.inject() is None
    with tracing.ingress_span("POST /v1/completions", {}, {}) as span:
        assert span is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracer.configure() is None


def test_one_connected_trace_under_the_clients_span(exporter: InMemorySpanExporter) -> None:
    headers = [("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")]
    now = time.monotonic()
    metrics = RequestMetrics(arrival_time=now - 1.0, first_scheduled_time=now - 0.9, first_token_time=now - 0.5,
                             last_token_time=now - 0.1, finished_time=now, finish_reason="length",
                             num_prompt_tokens=7, num_generation_tokens=4, num_cached_tokens=0, num_prefill_chunks=2,
                             num_preemptions=0, num_draft_tokens=6, num_accepted_tokens=3)
    attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "tandem"}
    with tracing.ingress_span("POST /v1/completions", headers, attrs):
        carrier = tracer.inject()
        tracing.note_group_request("tandem-demo", SamplingParams(max_tokens=4, temperature=0.0), response_id="cmpl-1")
        tracing.record_route(carrier, time.time_ns(), time.time_ns(), {"tandem.route.decision": "load"})
        tracer.record_group_spans(carrier, metrics, group_id="g0", model="tandem-demo", request_id="cmpl-1-0")
        tracing.note_usage(7, 4, ["length"])
    tracer.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    # The ingress span is named {gen_ai.operation.name} {gen_ai.request.model} once the model is known.
    assert sorted(spans) == ["decode", "group_request", "prefill", "queue", "route", "text_completion tandem-demo"]
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {TRACE_ID}
    ingress = spans["text_completion tandem-demo"]
    assert format(ingress.parent.span_id, "016x") == CLIENT_SPAN
    parent_of = {name: next(n for n, p in spans.items() if p.context.span_id == s.parent.span_id)
                 for name, s in spans.items() if name != ingress.name}
    assert parent_of == {"route": ingress.name, "group_request": ingress.name, "queue": "group_request",
                         "prefill": "group_request", "decode": "group_request"}
    assert dict(ingress.attributes) == {
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "tandem",
        "gen_ai.request.model": "tandem-demo", "gen_ai.request.max_tokens": 4, "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_p": 1.0, "gen_ai.response.id": "cmpl-1", "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 4, "gen_ai.response.finish_reasons": ("length",)}
    # Only the ingress span is a GenAI operation: a GenAI-aware backend counts the request once.
    assert [s.name for s in spans.values() if "gen_ai.operation.name" in s.attributes] == [ingress.name]
    group = spans["group_request"]
    assert group.attributes["tandem.spec.acceptance_rate"] == 0.5
    assert [e.name for e in group.events] == ["first_token", "finish"]
    assert spans["prefill"].attributes["tandem.prefill.num_chunks"] == 2
    # the phases tile the request: queue ends where prefill starts, prefill where decode starts
    assert spans["queue"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time == spans["decode"].events[0].timestamp


def _serve_http(path: str, reach_group: bool) -> None:
    """One request through TracingMiddleware to an app that, if `reach_group`, sends two
    group requests (two prompts of n=2) as the ingress would."""
    import asyncio

    async def app(scope: dict, receive, send) -> None:
        if reach_group:
            for num_output_tokens, reasons in ((3, ["stop", "length"]), (5, ["length", "length"])):
                tracing.note_group_request("tandem-demo", SamplingParams(n=2, max_tokens=3, top_k=5, seed=7))
                tracing.note_usage(6, num_output_tokens, reasons)
        await send({"type": "http.response.start", "status": 200 if reach_group else 400})
        await send({"type": "http.response.body", "body": b"{}"})

    async def noop(message: dict) -> None:
        pass

    scope = {"type": "http", "path": path, "method": "POST", "headers": [(b"x-request-id", b"req-1")]}
    asyncio.run(tracing.TracingMiddleware(app)(scope, noop, noop))


def test_an_http_request_span_is_named_by_operation_and_model(exporter: InMemorySpanExporter) -> None:
    _serve_http("/v1/chat/completions", reach_group=True)
    _serve_http("/v1/completions", reach_group=False)  # refused before a group: no model, its HTTP name
    tracer.force_flush()
    chat, refused = exporter.get_finished_spans()
    assert (chat.name, refused.name) == ("chat tandem-demo", "POST /v1/completions")
    assert dict(chat.attributes) == {
        "http.request.method": "POST", "url.path": "/v1/chat/completions", "gen_ai.request.id": "",
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "tandem", "gen_ai.request.model": "tandem-demo",
        "gen_ai.request.max_tokens": 3, "gen_ai.request.temperature": 1.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.request.top_k": 5, "gen_ai.request.seed": 7, "gen_ai.request.choice.count": 2,
        "http.response.status_code": 200, "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 8,
        "gen_ai.response.finish_reasons": ("stop", "length", "length", "length")}
    assert dict(refused.attributes) == {
        "http.request.method": "POST", "url.path": "/v1/completions", "gen_ai.request.id": "",
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "tandem",
        "http.response.status_code": 400, "gen_ai.usage.input_tokens": 0, "gen_ai.usage.output_tokens": 0}


class _CollectedMidExport(InMemorySpanExporter):
    """An exporter during whose export a finalizer flushes, as when garbage collection finds
    an ingress or group server while spans are being serialised on the same thread."""

    def __init__(self) -> None:
        super().__init__()
        self.finalizer_returned = 0

    def export(self, spans):
        result = super().export(spans)
        tracer.flush_on_stop(timeout_s=0.2)  # OpenAIIngress.__del__ / GroupServer.__del__
        self.finalizer_returned += 1
        return result


def test_a_finalizer_flushing_during_an_export_on_its_thread_does_not_deadlock() -> None:
    import threading

    exporter = _CollectedMidExport()
    tracer.configure(exporter)
    try:
        with tracer.tracer().start_as_current_span("a"):
            pass
        # force_flush holds the batch processor's (non-reentrant) lock while it exports; a
        # flush on this same thread would wait for itself forever.
        flushing = threading.Thread(target=tracer.force_flush, daemon=True)
        flushing.start()
        flushing.join(30)
        assert not flushing.is_alive()
        assert exporter.finalizer_returned == 1
        assert [span.name for span in exporter.get_finished_spans()] == ["a"]
    finally:
        tracer.configure(None)


def test_a_chat_rpc_span_says_chat(exporter: InMemorySpanExporter) -> None:
    class Context:
        def invocation_metadata(self) -> list:
            return []

        def set_trailing_metadata(self, metadata) -> None:
            pass

    class Servicer:
        @tracing.traced_rpc("Chat", "chat")
        async def chat(self, request, grpc_context):
            tracing.note_group_request("tandem-demo", SamplingParams(max_tokens=2))
            return "reply"

    import asyncio

    assert asyncio.run(Servicer().chat(None, Context())) == "reply"
    tracer.force_flush()
    [span] = exporter.get_finished_spans()
    assert (span.name, span.attributes["gen_ai.operation.name"], span.attributes["rpc.method"]) == (
        "chat tandem-demo", "chat", "Chat")
