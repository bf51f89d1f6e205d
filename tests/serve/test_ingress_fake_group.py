"""The HTTP layer and EngineClient against a scripted fake group: no Ray, so fast and exact.

Covers what a real group rarely does on demand: refusing a request, failing mid-stream,
failing before its first token (retried once elsewhere), Serve's back-pressure
(overload), no group running, a request's own timeout, and the cancel on early exit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from tandem.router import ingress
from tandem.router.engine_client import EngineClient, ServiceUnavailable, sampling_params
from tandem.workers.core.request import CompletionOutput, SamplingParams
from tandem.workers.serving.messages import ErrorKind, GroupDelta, GroupRequest
from tandem.workers.serving.outbox import Outboxes
from tests.serve.fake_group import FakeChannel, FakeResponse, scripted_response


def delta(text: str, token_id: int, finish: str | None = None, *, index: int = 0, error: str | None = None,
          error_kind: ErrorKind | None = None) -> GroupDelta:
    outputs = [] if error and error_kind == "invalid_request" else [
        CompletionOutput(index, text, [token_id], None, finish_reason=finish)]
    return GroupDelta("r", "g0", outputs, finish is not None or error is not None, num_prompt_tokens=3,
                      error=error, error_kind=error_kind)


class FakeGroup:
    """A DeploymentHandle to a group whose answers are scripted per call."""

    def __init__(self) -> None:
        self.script: list = []
        self.scripts: list[list] = []  # one script per call, first call first (else `script` every time)
        self.calls: list[GroupRequest] = []
        self.responses: list[FakeResponse] = []
        self.generate = self
        self.outboxes = Outboxes()
        self.channel = FakeChannel(self.outboxes)

    def options(self, **_):
        return self

    def remote(self, request: GroupRequest) -> FakeResponse:
        self.calls.append(request)
        script = list(self.scripts.pop(0) if self.scripts else self.script)
        self.responses.append(scripted_response(script, self.outboxes, request))
        return self.responses[-1]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tandem.workers.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama)


@pytest.fixture
def group() -> FakeGroup:
    return FakeGroup()


@pytest.fixture
def status():
    with mock.patch.object(EngineClient, "_read_group_status", return_value=(True, True)) as read:
        yield read


@contextmanager
def served(tiny_llama, group, app=ingress.app) -> Iterator[TestClient]:
    """A client of an ingress over `group`, through `app` (ingress.app, or a wrapper of it)."""
    # The class as written (Serve's ingress wrapper subclasses it); its routes are on ingress.app.
    wrapper = ingress.OpenAIIngress.func_or_class
    cls = next(c for c in wrapper.__mro__[1:] if c.__name__ == "OpenAIIngress")
    server = cls(group, {"model": tiny_llama, "served_model_name": "tiny", "max_model_len": 64})
    with mock.patch("ray.serve.get_replica_context") as context:
        context.return_value.servable_object = server
        context.return_value.app_name = "tandem"
        with TestClient(app) as client:  # one event loop for every request, as in a replica
            yield client


@pytest.fixture
def http(tiny_llama, group, status):
    with served(tiny_llama, group) as client:
        yield client


def post(http, body, path="/v1/completions"):
    return http.post(path, json={"model": "tiny", **body})


@pytest.fixture
def bodies(tiny_llama, group, status):
    """A client, and the body messages of each response as the ingress sends them (each one a
    socket write in a replica): (bytes, more_body)."""
    sent: list[tuple[bytes, bool]] = []

    async def recording(scope, receive, send):
        async def record(message):
            if message["type"] == "http.response.body":
                sent.append((message.get("body", b""), message.get("more_body", False)))
            await send(message)

        await ingress.app(scope, receive, record)

    with served(tiny_llama, group, recording) as client:
        yield client, sent


def test_a_streams_last_delta_usage_and_done_close_it_in_one_write(bodies, group):
    client, sent = bodies
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        sent.clear()
        group.script = [delta("Hel", 10), delta("lo", 11), delta("!", 12, "stop")]
        r = post(client, {**body, "stream": True, "stream_options": {"include_usage": True}}, path)
        assert r.status_code == 200
        assert [more for _, more in sent] == [True] * (len(sent) - 1) + [False]
        events = [e for e in sent[-1][0].decode().split("\n\n") if e]
        assert len(events) == 3 and events[-1] == "data: [DONE]"
        last, usage = json.loads(events[0][len("data: "):]), json.loads(events[1][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "stop" and usage["usage"]["completion_tokens"] == 3
        assert b"".join(b for b, _ in sent).decode() == r.text  # what was written is the response
        if path == "/v1/chat/completions":
            # the role chunk goes out with the first token: one write
            first = [json.loads(e[len("data: "):]) for e in sent[0][0].decode().split("\n\n") if e]
            assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert first[1]["choices"][0]["delta"]["content"].startswith("Hel")


def test_an_error_mid_stream_closes_it_in_one_write(bodies, group):
    client, sent = bodies
    group.script = [delta("a", 10), delta("", 0, error="worker died", error_kind="unavailable")]
    r = post(client, {"prompt": "hi", "stream": True})
    assert r.status_code == 200 and sent[-1][1] is False
    error, done = [e for e in sent[-1][0].decode().split("\n\n") if e]
    assert json.loads(error[len("data: "):])["error"]["code"] == "service_unavailable" and done == "data: [DONE]"


def test_streams_the_groups_deltas_as_sse(http, group):
    group.script = [delta("Hel", 10), delta("lo", 11), delta("!", 12, "stop")]
    r = post(http, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["x-tandem-groups"] == "g0"
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # Deltas that wait for the client are joined into one chunk (router/group_channels.py): how
    # they split depends on the client thread's timing; what they say does not.
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello!"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "stop"
    assert chunks[0]["choices"][0]["text"] == "Hel"  # the first token is never held back
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert group.calls[0].sampling.max_tokens == 16  # the completions default


def test_only_a_streaming_request_asks_its_group_for_every_delta(http, group):
    # A request answered whole gets one delta from its group, at the end (final_only).
    group.script = [delta("Hello", 10, "length")]
    for path, body in (("/v1/completions", {"prompt": ["hi", "ho"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            group.calls.clear()
            r = post(http, {**body, "stream": stream}, path)
            assert r.status_code == 200
            assert [c.final_only for c in group.calls] == [not stream] * len(group.calls)
            assert len(group.calls) == (2 if path == "/v1/completions" else 1)
    assert post(http, {"prompt": "hi"}).json()["choices"][0]["text"] == "Hello"


def test_group_refusal_is_a_400_before_any_byte(http, group):
    group.script = [delta("", 0, error="prompt: 60 tokens need 5 KV blocks but the cache holds 4",
                          error_kind="invalid_request")]
    for stream in (False, True):
        r = post(http, {"prompt": "hi", "stream": stream})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt"


def test_group_failure_mid_stream_is_an_error_event(http, group):
    group.script = [delta("a", 10), delta("", 0, error="worker died", error_kind="unavailable")]
    r = post(http, {"prompt": "hi", "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
    assert json.loads(events[1][6:])["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]"
    group.script = [delta("a", 10), delta("", 0, error="worker died", error_kind="unavailable")]
    assert post(http, {"prompt": "hi"}).status_code == 503


def test_overload_is_503(http, group):
    group.script = [BackPressureError(num_queued_requests=9, max_queued_requests=8)]
    r = post(http, {"prompt": "hi"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "service_unavailable"


def test_health_is_ready_while_a_group_serves_and_live_while_the_ingress_answers(http, group, status):
    status.return_value = (False, False)
    with mock.patch("tandem.router.engine_client._HEALTH_TTL_S", 0.0):
        assert post(http, {"prompt": "hi"}).status_code == 503
        health = http.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "unavailable", "groups": {}})
        assert group.calls == []  # never sent
        assert (http.get("/live").status_code, http.get("/live").json()) == (200, {"status": "alive"})
        # One of two groups down: the service still serves, so a load balancer keeps it in.
        status.return_value = (False, True)
        group.script = [delta("x", 10, "length")]
        assert post(http, {"prompt": "hi", "max_tokens": 1}).status_code == 200
        health = http.get("/health")
        assert (health.status_code, health.json()["status"]) == (200, "degraded")
        status.return_value = (True, True)
        assert http.get("/health").json()["status"] == "ok"


def test_context_length_is_checked_at_the_ingress(http, group):
    r = post(http, {"prompt": "hi", "max_tokens": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "maximum context length is 64" in r.json()["error"]["message"]
    assert group.calls == []


def test_early_exit_cancels_the_group_request(tokenizer, group):
    client = EngineClient(group, tokenizer=tokenizer, model_name="tiny", max_model_len=64, vocab_size=512)
    client._status = (float("inf"), True, True)  # fresh for ever: no Serve to ask
    group.script = [delta("a", 10), delta("b", 11), delta("c", 12, "length")]

    async def take_one():
        stream = client.stream(client.request("r1", [1, 2, 3], SamplingParams(max_tokens=3)))
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(take_one()).outputs[0].text == "a"
    assert group.responses[0].cancelled


def test_engine_client_validates_like_the_group(tokenizer, group):
    client = EngineClient(group, tokenizer=tokenizer, model_name="tiny", max_model_len=64, vocab_size=512)
    with pytest.raises(ValueError, match="^top_p:"):
        sampling_params({"top_p": 0.0})
    with pytest.raises(ValueError, match="^prompt:.*vocabulary"):
        client.request("r", [1, 512], SamplingParams())
    with pytest.raises(ValueError, match="^sampling:"):
        sampling_params({"nonsense": 1})
    with pytest.raises(ValueError, match="^messages: must not be empty"):
        client.request("r", [], SamplingParams(), field="messages")
    assert client.request("r", [1] * 60, SamplingParams(max_tokens=4)).sampling.max_tokens == 4


def test_service_unavailable_from_stream(tokenizer, group):
    client = EngineClient(group, tokenizer=tokenizer, model_name="tiny", max_model_len=64, vocab_size=512)
    client._status = (float("inf"), True, True)
    group.script = [BackPressureError(num_queued_requests=1, max_queued_requests=1)]

    async def consume():
        return [d async for d in client.stream(client.request("r", [1, 2], SamplingParams()))]

    with pytest.raises(ServiceUnavailable, match="overloaded"):
        asyncio.run(consume())


def test_group_that_fails_before_its_first_token_is_retried_once_elsewhere(http, group):
    died = delta("", 0, error="the replica group has failed: worker died", error_kind="unavailable")
    group.scripts = [[died], [delta("a", 10), delta("b", 11, "stop")]]
    r = post(http, {"prompt": "hi"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
    assert [c.avoid_group for c in group.calls] == [None, "g0"]
    # A replica that dies is the same (Ray says so with an exception: no group id to avoid).
    group.calls.clear()
    group.scripts = [[ActorDiedError()], [delta("c", 12, "stop")]]
    r = post(http, {"prompt": "hi", "stream": True})
    assert json.loads(r.text.splitlines()[0][6:])["choices"][0]["text"] == "c"
    assert [c.avoid_group for c in group.calls] == [None, None]


def test_a_second_failure_or_one_after_a_token_is_not_retried(http, group):
    died = delta("", 0, error="worker died", error_kind="unavailable")
    group.scripts = [[died], [died]]
    r = post(http, {"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert len(group.calls) == 2
    group.calls.clear()
    group.scripts = [[delta("a", 10), ActorDiedError()]]
    r = post(http, {"prompt": "hi", "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[1])["error"]["code"] == "service_unavailable" and events[2] == "[DONE]"
    assert len(group.calls) == 1


def test_timeout_aborts_the_request_with_408(http, group):
    for script in ([5.0, delta("a", 10, "stop")], [delta("a", 10), 5.0, delta("b", 11, "stop")]):
        group.scripts = [list(script)]
        r = post(http, {"prompt": "hi", "timeout": 0.2})
        assert r.status_code == 408
        assert r.json()["error"] == {"message": "timeout: the request's timeout passed before it finished",
                                     "type": "timeout_error", "param": "timeout", "code": "request_timeout"}
        assert group.responses[-1].cancelled  # the group aborts it and frees its KV
    group.scripts = [[delta("a", 10), 5.0, delta("b", 11, "stop")]]
    # 1 s, not 0.2: the first delta must come before the deadline on a loaded host too.
    r = post(http, {"prompt": "hi", "timeout": 1.0, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["code"] == "request_timeout" and events[2] == "[DONE]"
    assert group.responses[-1].cancelled
    for bad in (0, -1, "5"):
        r = post(http, {"prompt": "hi", "timeout": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"


def test_a_request_without_a_timeout_gets_the_servers(tiny_llama, group):
    from tests.serve.fake_group import ingress_server, serving

    # 1 s: the first delta comes well before the deadline on a loaded host too.
    with serving(ingress_server(tiny_llama, group, request_timeout_s=1.0)) as client:
        group.scripts = [[delta("a", 10), 5.0, delta("b", 11, "stop")]] * 2
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (408, "request_timeout")
        assert group.responses[-1].cancelled
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert [json.loads(events[0])["choices"][0]["text"], json.loads(events[1])["error"]["code"], events[2]] == [
            "a", "request_timeout", "[DONE]"]
        assert group.responses[-1].cancelled  # the group aborts it and frees its KV


def test_grpc_timeout_is_deadline_exceeded() -> None:
    import grpc

    from tandem.router import tandem_pb2 as pb
    from tandem.router.engine_client import RequestTimeout
    from tandem.router.grpc_service import _deadline, _set_status

    context = mock.Mock()
    _set_status(context, RequestTimeout("the request's timeout passed before it finished"))
    context.set_code.assert_called_once_with(grpc.StatusCode.DEADLINE_EXCEEDED)
    context.set_details.assert_called_once_with("timeout: the request's timeout passed before it finished")
    assert _deadline(pb.GenerateRequest()) is None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="^timeout: must be > 0 seconds"):
            _deadline(pb.GenerateRequest(timeout=bad))
