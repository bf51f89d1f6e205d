"""The hostile-input battery (tests/serve/hostile_cases.py) against the ingress over a fake group.

Every bad request gets its exact status, an OpenAI-shaped error body naming the field,
no trace of the server's insides, and never reaches a group; the server answers a
normal request afterwards. The same table's gRPC half runs through GrpcMethods on the
same ingress. A subset also runs against the real server (test_openai_api.py).
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest

from tandem.router import tandem_pb2 as pb
from tests.serve.fake_group import EchoGroup, FakeGrpcContext, ingress_server, serving
from tests.serve.hostile_cases import (
    ACCEPTED_CASES,
    API_KEY,
    AUTH,
    COMPLETION,
    GRPC_CASES,
    HTTP_CASES,
    GrpcCase,
    HttpCase,
)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error"}
# What an error body must never show: a traceback, a source file, an install path.
INSIDES = re.compile(r'Traceback|File "|\.py\b|site-packages|/work/|/home/|/usr/')


@pytest.fixture(scope="module")
def served(tiny_llama):
    group = EchoGroup()
    server = ingress_server(tiny_llama, group, api_key=API_KEY, admission={"max_requests_per_group": 64})
    with serving(server) as client:
        yield server, client, group


def send(client, case: HttpCase):
    headers = {**AUTH, **case.headers}
    body = case.body
    if isinstance(body, dict):  # ASCII-escaped, so that a lone surrogate travels as "\\ud800"
        body = json.dumps(body).encode()
        headers = {"content-type": "application/json", **headers}
    return client.request(case.method, case.path, content=body, headers=headers)


def assert_openai_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"]
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert not INSIDES.search(response.text), response.text[:500]
    assert error["type"] == ERROR_TYPES.get(status, error["type"])
    assert (error["param"], error["code"]) == (param, code) if code is not None else error["param"] == param
    return error


def test_the_battery_has_at_least_60_bad_inputs():
    assert len({c.name for c in HTTP_CASES}) == len(HTTP_CASES) == 112
    assert len({c.name for c in GRPC_CASES}) == len(GRPC_CASES) == 31
    print(f"hostile inputs: {len(HTTP_CASES)} HTTP + {len(GRPC_CASES)} gRPC = {len(HTTP_CASES) + len(GRPC_CASES)}")


@pytest.mark.parametrize("case", HTTP_CASES, ids=lambda c: c.name)
def test_bad_http_input_gets_its_4xx(served, case: HttpCase):
    _, client, group = served
    num_calls = len(group.calls)
    response = send(client, case)
    error = assert_openai_error(response, case.status, case.param, case.code)
    if case.message_has:
        assert case.message_has in error["message"]
    if case.status == 405:
        assert case.method not in response.headers["allow"]
    assert len(group.calls) == num_calls  # refused at the ingress: no group saw it


@pytest.mark.parametrize("case", ACCEPTED_CASES, ids=lambda c: c.name)
def test_odd_but_valid_input_is_served(served, case: HttpCase):
    _, client, _ = served
    response = send(client, case)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_body_over_the_limit_without_a_length_is_cut_off_at_the_limit(served):
    _, client, group = served
    read = []

    def chunks():  # chunked transfer encoding: no Content-Length to refuse up front
        for _ in range(12):
            read.append(1)
            yield b" " * (1024 * 1024)

    response = client.post("/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(response, 413, None, "request_too_large")
    assert "8388608 bytes" in response.json()["error"]["message"]


def test_bodies_past_the_replicas_body_budget_get_429_before_they_are_read(served):
    server, client, _ = served
    budget = server.body_budget
    assert budget.max_bytes == 32 * 8 * 1024 * 1024 and budget.held == 0
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    headers = {**AUTH, "content-type": "application/json"}
    budget.held = budget.max_bytes - len(body) + 1  # other bodies being read hold all but a body less one byte
    try:
        response = client.post("/v1/completions", content=body, headers=headers)
        assert_openai_error(response, 429, None, "overloaded")
        assert response.headers["retry-after"] == "1"
        room = budget.max_bytes - budget.held

        def chunks():  # no Content-Length: refused at the chunk that crosses the budget (the second)
            for _ in range(8):
                yield b" " * (room - 1)

        response = client.post("/v1/completions", content=chunks(), headers=headers)
        assert_openai_error(response, 429, None, "overloaded")
        assert budget.held == budget.max_bytes - len(body) + 1  # what each took is given back
    finally:
        budget.held = 0
    response = client.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert (budget.held, budget.num_refused) == (0, 2)


async def _grpc(server, case: GrpcCase) -> FakeGrpcContext:
    context = FakeGrpcContext(list(case.metadata))
    response = await server.Generate(case.request, context)
    assert response == pb.GenerateResponse()  # an error: an empty message, the status on the context
    stream_context = FakeGrpcContext(list(case.metadata))
    with pytest.raises(Exception):  # noqa: B017 - streaming: the method raises after setting the status
        async for _ in server.GenerateStream(case.request, stream_context):
            pass
    assert (stream_context.code, stream_context.details) == (context.code, context.details)
    return context


@pytest.mark.parametrize("case", GRPC_CASES, ids=lambda c: c.name)
def test_bad_grpc_input_gets_its_status(served, case: GrpcCase):
    server, _, group = served
    num_calls = len(group.calls)
    context = asyncio.run(_grpc(server, case))
    assert context.code == case.code, context.details
    assert case.details_has in context.details
    assert not INSIDES.search(context.details)
    assert len(group.calls) == num_calls


def test_the_server_still_serves_after_the_battery(served):
    server, client, _ = served
    response = client.post("/v1/completions", json=COMPLETION, headers=AUTH)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "t10t11"
    context = FakeGrpcContext([("authorization", f"Bearer {API_KEY}")])
    reply = asyncio.run(server.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                        context))
    assert context.code is None and reply.choices[0].text == "t10t11"
    assert server.admission.in_flight == 0  # every refused request gave its place back
    assert grpc.StatusCode.OK not in {c.code for c in GRPC_CASES}
