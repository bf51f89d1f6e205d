"""The work one request may ask for (router/limits.py), the same over HTTP and gRPC, what
admission charges for it (its sequences), and request ids that belong to the server."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest
from starlette.requests import Request

from tandem.router import limits
from tandem.router import tandem_pb2 as pb
from tandem.router.body_budget import BodyBudget
from tandem.router.limits import RequestLimits
from tests.serve.fake_group import EchoGroup, FakeGrpcContext, ingress_server, serving


@pytest.fixture
def group() -> EchoGroup:
    return EchoGroup()


def _completion(n: int, prompts: int, **fields) -> dict:
    return {"model": "tiny", "prompt": [[5, 6]] * prompts, "max_tokens": 2, "n": n, **fields}


def _generate(server, request: pb.GenerateRequest) -> tuple[FakeGrpcContext, pb.GenerateResponse]:
    context = FakeGrpcContext()
    reply = asyncio.run(server.Generate(request, context))
    return context, reply


def test_admission_charges_each_sequence_not_each_request(tiny_llama, group):
    server = ingress_server(tiny_llama, group, admission={"max_requests_per_group": 8})
    with serving(server) as client:
        with client.stream("POST", "/v1/completions", json=_completion(3, 2, stream=True)) as response:
            assert response.status_code == 200
            assert server.admission.in_flight == 6  # 2 prompts x n = 3
            context, _ = _generate(server, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                                              sampling=pb.SamplingParams(n=3, max_tokens=2)))
            assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # 6 + 3 > 8: come back later
            body = response.read().decode()
        assert body.count('"text":"t10"') == 6 and server.admission.in_flight == 0
        over = client.post("/v1/completions", json=_completion(5, 2))  # 10 sequences, 8 allowed
        assert over.status_code == 429 and over.json()["error"]["code"] == "overloaded"
        assert client.post("/v1/completions", json=_completion(4, 2)).status_code == 200
        # One prompt's samples run on one group: more than a group admits is never admitted,
        # so it is a 400 (not a 429 that a client would retry for ever).
        never = client.post("/v1/completions", json=_completion(9, 1))
        assert never.status_code == 400 and never.json()["error"]["message"] == (
            "n: 9 samples of one prompt are more than one replica group admits (8 sequences)")
    context, _ = _generate(server, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                                      sampling=pb.SamplingParams(n=9, max_tokens=2)))
    assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, "n: 9 samples of one prompt are "
                                               "more than one replica group admits (8 sequences)")
    context, reply = _generate(server, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                                          sampling=pb.SamplingParams(n=8, max_tokens=2)))
    assert context.code is None and [c.text for c in reply.choices] == ["t10t11"] * 8
    assert server.admission.in_flight == 0


def test_serving_options_lower_the_bounds_on_both_apis(tiny_llama, group):
    server = ingress_server(tiny_llama, group,
                            limits={"max_n": 4, "max_logprobs": 5, "max_sequences_per_request": 6})
    with serving(server) as client:
        cases = [
            ("/v1/completions", _completion(5, 1), "n", "n: at most 4 samples per prompt on this server, got 5"),
            ("/v1/completions", _completion(4, 2), "n",
             "n: prompts x n may be at most 6 sequences per request on this server, got 2 x 4"),
            ("/v1/completions", _completion(1, 1, logprobs=6), "logprobs",
             "logprobs: at most 5 alternatives per position on this server, got 6"),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "logprobs": True, "top_logprobs": 6}, "top_logprobs",
             "top_logprobs: at most 5 alternatives per position on this server, got 6"),
        ]
        for path, body, param, message in cases:
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"] | {"type": None} == {
                "message": message, "param": param, "code": "invalid_value", "type": None}
        assert client.post("/v1/completions", json=_completion(3, 2, logprobs=5)).status_code == 200
    for sampling, details in [(pb.SamplingParams(n=5), "n: at most 4 samples per prompt on this server, got 5"),
                              (pb.SamplingParams(logprobs=6),
                               "logprobs: at most 5 alternatives per position on this server, got 6")]:
        context, _ = _generate(server, pb.GenerateRequest(text="hi", sampling=sampling))
        assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert len(group.calls) == 2  # only the request within the bounds reached the group (2 prompts)


def test_bounds_beyond_what_the_api_allows_are_refused():
    for field, value, message in [("max_n", 0, r"max_n: must be in \[1, 128\], got 0"),
                                  ("max_n", 129, r"max_n: must be in \[1, 128\], got 129"),
                                  ("max_logprobs", 21, r"max_logprobs: must be in \[0, 20\], got 21"),
                                  ("max_sequences_per_request", 0, "max_sequences_per_request: must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            RequestLimits(**{field: value})
    assert RequestLimits().sequences(128, 2) == 256


def _json_request(body: bytes) -> Request:
    """A POST of `body` as JSON, its body in one message."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": [(b"content-type", b"application/json")]}, receive)


def test_a_large_body_is_parsed_on_a_thread_and_a_small_one_on_the_loop(monkeypatch):
    parsed_on: list[int] = []
    parse = limits.parse_json_object

    def recording(body: bytes, max_depth: int) -> dict:
        parsed_on.append(threading.get_ident())
        return parse(body, max_depth)

    monkeypatch.setattr(limits, "parse_json_object", recording)

    async def read(body: bytes) -> tuple[dict, int]:
        budget = BodyBudget(1 << 30)
        value = await limits.read_json_object(_json_request(body), RequestLimits(), budget)
        assert budget.held == 0
        return value, threading.get_ident()

    small, loop = asyncio.run(read(b'{"prompt": "hi"}'))
    assert small == {"prompt": "hi"} and parsed_on == [loop]
    prompt = "a" * limits.PARSE_ON_THREAD_BYTES
    large, loop = asyncio.run(read(json.dumps({"prompt": prompt}).encode()))
    assert large == {"prompt": prompt} and parsed_on[1] != loop


def test_a_request_cancelled_while_its_body_parses_holds_the_budget_until_the_parse_ends(monkeypatch):
    started, release = threading.Event(), threading.Event()
    parse = limits.parse_json_object

    def slow(body: bytes, max_depth: int) -> dict:
        started.set()
        release.wait(timeout=30)
        return parse(body, max_depth)

    monkeypatch.setattr(limits, "parse_json_object", slow)
    body = json.dumps({"prompt": "a" * limits.PARSE_ON_THREAD_BYTES}).encode()

    async def main() -> None:
        budget = BodyBudget(1 << 30)
        reading = asyncio.create_task(limits.read_json_object(_json_request(body), RequestLimits(), budget))
        await asyncio.to_thread(started.wait, 30)
        reading.cancel()
        for _ in range(20):  # the cancellation is delivered; the thread still has the body
            await asyncio.sleep(0)
        assert not reading.done() and budget.held == len(body)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert budget.held == 0

    asyncio.run(main())


def test_arrays_and_objects_past_the_bound_are_refused_before_parsing_but_brackets_in_strings_are_text():
    bound = limits.MAX_JSON_CONTAINERS
    empty = b'{"prompt": "hi", "x": [' + b"[]," * bound + b"[]]}"  # bound + 2 arrays
    with pytest.raises(limits.OpenAIError) as refused:
        limits.parse_json_object(empty, 32)
    error = refused.value.body.error
    assert (refused.value.status, error.code, error.message) == (
        400, "invalid_json", f"the request body holds more than {bound} JSON arrays and objects")
    at_bound = b'{"x": [' + b"{}," * (bound - 3) + b"{}]}"  # the body, its array and bound - 2 objects
    assert len(limits.parse_json_object(at_bound, 32)["x"]) == bound - 2
    # Brackets, escaped quotes and backslashes inside strings are no containers.
    text = '[{"a": "\\"}] ' * bound
    assert limits.parse_json_object(json.dumps({"prompt": text, "stop": ["]\\", '"[']}).encode(), 32) == {
        "prompt": text, "stop": ["]\\", '"[']}
    assert limits._containers(json.dumps({"p": text, "q": [[1], {"r": '\\"{'}]}).encode()) == 4


def test_the_depth_walk_runs_only_for_bodies_with_more_brackets_than_the_depth(monkeypatch):
    walked: list[object] = []
    depth = limits._depth

    def recording(value: object, limit: int) -> int:
        walked.append(value)
        return depth(value, limit)

    monkeypatch.setattr(limits, "_depth", recording)
    ids = b"[" + b",".join(b"7" for _ in range(100_000)) + b"]"  # a long prompt of ids: never walked
    assert limits.parse_json_object(b'{"prompt": ' + ids + b"}", 4)["prompt"] == [7] * 100_000
    assert walked == []
    many = {"prompt": [[1], [2], [3], [4]]}  # five lists, two deep: walked, and within the bound
    assert limits.parse_json_object(json.dumps(many).encode(), 4) == many and walked == [many]


def test_a_clients_grpc_request_id_is_a_label_the_engine_never_sees(tiny_llama, group):
    server = ingress_server(tiny_llama, group)

    async def both() -> list:
        async def one(label: str) -> list[pb.GenerateStreamResponse]:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), request_id=label,
                                         sampling=pb.SamplingParams(max_tokens=2))
            return [message async for message in server.GenerateStream(request, FakeGrpcContext())]

        return await asyncio.gather(one("same"), one("same"), one("x#1"), one(""))

    with serving(server):
        streams = asyncio.run(both())
    for label, messages in zip(["same", "same", "x#1"], streams):
        assert [m.request_id for m in messages] == [label, label]
        assert "".join(c.text for m in messages for c in m.choices) == "t10t11"
    engine_ids = [call.request_id for call in group.calls]
    assert len(set(engine_ids)) == 4 and all(i.startswith("grpc-") and "#" not in i for i in engine_ids)
    assert [m.request_id for m in streams[3]] == [engine_ids[3]] * 2  # no label: the server's id
    context, reply = _generate(server, pb.GenerateRequest(text="hi", request_id="mine",
                                                          sampling=pb.SamplingParams(max_tokens=2)))
    assert context.code is None and reply.request_id == "mine" and group.calls[-1].request_id != "mine"
