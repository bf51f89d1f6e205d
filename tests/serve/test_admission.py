"""Admission control (router/admission.py): shed at the door, with exact statuses and headers.

The bounds, the tickets and their release run without Serve; the HTTP and gRPC answers
run on the ingress over a fake group (tests/serve/fake_group.py), whose in-flight count
is set directly so that "full" is exact rather than raced for.
"""

from __future__ import annotations

import asyncio
import gc
from unittest import mock

import grpc
import pytest
from ray.serve.exceptions import BackPressureError

from tandem.router import engine_client
from tandem.router import tandem_pb2 as pb
from tandem.router.admission import Admission, AdmissionLimits, NoGroupUp, Overloaded, ReleasingStream
from tandem.router.app import SERVING_DEFAULTS, admission_options
from tandem.router.engine_client import EngineClient
from tandem.router.grpc_service import RpcError
from tandem.workers.config import EngineConfig
from tests.serve.fake_group import EchoGroup, FakeGrpcContext, ingress_server, serving

PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def admission(groups_up: int = 1, **limits) -> Admission:
    async def up() -> int:
        return groups_up

    return Admission(AdmissionLimits(**{"max_requests_per_group": 2, **limits}), up)


# ---- the bounds --------------------------------------------------------------------------------
def test_bound_is_per_group_up_and_capped_per_application():
    async def scenario():
        two_groups = admission(groups_up=2, max_requests_per_group=3, max_requests=5, retry_after_s=7)
        tickets = [await two_groups.admit() for _ in range(5)]
        with pytest.raises(Overloaded) as info:
            await two_groups.admit()
        assert (str(info.value), info.value.retry_after_s) == (
            "5 requests in flight, at most 5 for 2 replica group(s)", 7)
        tickets[0].release()
        tickets[0].release()  # idempotent
        assert two_groups.in_flight == 4
        await two_groups.admit()
        one_group = admission(groups_up=1, max_requests_per_group=3)
        await one_group.admit(cost=2)
        with pytest.raises(Overloaded):
            await one_group.admit(cost=2)  # a two-prompt completion counts twice
        assert (one_group.num_admitted, one_group.num_shed) == (1, 1)
        with pytest.raises(NoGroupUp):
            await admission(groups_up=0).admit()

    asyncio.run(scenario())


def test_tickets_count_per_group_until_released():
    async def scenario():
        a = admission(max_requests_per_group=10)
        first, second = await a.admit(), await a.admit(cost=2)
        first.assign(["g0"])
        second.assign(["g0", "g1"])
        assert a.stats() == {"in_flight": 3, "by_group": {"g0": 2, "g1": 1}, "num_admitted": 2, "num_shed": 0}
        second.release()
        assert (a.in_flight, dict(a.by_group)) == (1, {"g0": 1})

    asyncio.run(scenario())


def test_a_stream_gives_its_ticket_back_however_it_ends():
    async def chunks():
        yield "a"
        yield "b"

    async def scenario():
        a = admission(max_requests_per_group=10)
        done, closed, dropped = await a.admit(), await a.admit(), await a.admit()
        assert [c async for c in ReleasingStream(chunks(), done)] == ["a", "b"] and done.released
        stream = ReleasingStream(chunks(), closed)
        assert await anext(stream) == "a"
        await stream.aclose()  # the client went away mid-stream
        assert closed.released
        ReleasingStream(chunks(), dropped)  # never iterated: a client gone before the first byte
        gc.collect()
        assert dropped.released and a.in_flight == 0

    asyncio.run(scenario())


def test_limits_are_validated():
    with pytest.raises(ValueError, match="^max_requests_per_group: must be >= 1"):
        AdmissionLimits(max_requests_per_group=0)
    with pytest.raises(ValueError, match="^max_requests: must be >= 1"):
        AdmissionLimits(max_requests_per_group=1, max_requests=0)


def test_build_app_splits_the_bounds_among_ingress_replicas():
    config = EngineConfig.from_options(max_num_seqs=8)
    assert admission_options(config, dict(SERVING_DEFAULTS)) == {
        "max_requests_per_group": 24, "max_requests": None, "retry_after_s": 1}  # 2 * 8 ongoing + 8 queued
    serving = {**SERVING_DEFAULTS, "ingress_num_replicas": 2, "max_requests_per_group": 5, "max_requests": 9,
               "retry_after_s": 3}
    assert admission_options(config, serving) == {"max_requests_per_group": 3, "max_requests": 5, "retry_after_s": 3}
    assert admission_options(config, {**SERVING_DEFAULTS, "admission_control": False}) is None


# ---- HTTP and gRPC answers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_llama):
    group = EchoGroup()
    server = ingress_server(tiny_llama, group, admission={"max_requests_per_group": 2, "retry_after_s": 3})
    with serving(server) as client:
        yield server, client, group


@pytest.fixture
def full(served):
    """The ingress with both of its places taken (by requests that are not there)."""
    server = served[0]
    server.admission.in_flight = 2
    yield server
    server.admission.in_flight = 0


def test_full_is_429_with_retry_after_before_any_tokenizing(served, full):
    _, client, group = served
    with mock.patch.object(full.client, "tokenizer", side_effect=AssertionError("tokenized")):
        for path, body in (("/v1/completions", PROMPT),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            response = client.post(path, json=body)
            assert response.status_code == 429
            assert response.headers["retry-after"] == "3"
            assert response.json() == {"error": {
                "message": "overloaded: 2 requests in flight, at most 2 for 1 replica group(s); retry after 3 s",
                "type": "rate_limit_error", "param": None, "code": "overloaded"}}
    assert group.calls == []


def test_a_completion_counts_once_per_prompt(served):
    server, client, group = served
    server.admission.in_flight = 1
    try:
        assert client.post("/v1/completions", json={**PROMPT, "prompt": ["a", "b"]}).status_code == 429
        assert client.post("/v1/completions", json=PROMPT).status_code == 200
        assert server.admission.in_flight == 1  # the admitted one is done and gave its place back
    finally:
        server.admission.in_flight = 0


def test_places_come_back_after_answers_streams_and_refusals(served):
    server, client, group = served
    num_shed = server.admission.num_shed
    assert client.post("/v1/completions", json=PROMPT).status_code == 200
    response = client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert client.post("/v1/completions", json={**PROMPT, "max_tokens": 100}).status_code == 400
    group.fail_with = BackPressureError(num_queued_requests=9, max_queued_requests=8)  # Serve's backstop
    response = client.post("/v1/completions", json=PROMPT)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert server.admission.in_flight == 0 and server.admission.num_shed == num_shed


def test_no_group_up_is_503_with_retry_after(served):
    server, client, group = served
    num_calls = len(group.calls)
    with mock.patch.object(EngineClient, "_read_group_status", return_value=(False, False)), \
            mock.patch.object(engine_client, "_HEALTH_TTL_S", 0.0):
        response = client.post("/v1/completions", json=PROMPT)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "3"
        assert response.json()["error"] == {"message": "service unavailable: no replica group is running",
                                            "type": "server_error", "param": None, "code": "service_unavailable"}
        context = FakeGrpcContext()
        asyncio.run(server.Generate(pb.GenerateRequest(text="hi"), context))
        assert (context.code, context.trailing) == (grpc.StatusCode.UNAVAILABLE, [("retry-after", "3")])
    assert len(group.calls) == num_calls
    server.client._status = (float("-inf"), True, True)  # forget the "no": the next test's groups are up


def test_full_is_resource_exhausted_over_grpc(served, full):
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    context = FakeGrpcContext()
    assert asyncio.run(full.Generate(request, context)) == pb.GenerateResponse()
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.details == "overloaded: 2 requests in flight, at most 2 for 1 replica group(s)"
    assert context.trailing == [("retry-after", "3")]

    async def stream():
        return [m async for m in full.GenerateStream(request, stream_context)]

    stream_context = FakeGrpcContext()
    with pytest.raises(RpcError) as raised:
        asyncio.run(stream())
    assert stream_context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (raised.value.code, raised.value.details) == (stream_context.code, stream_context.details)
    full.admission.in_flight = 0
    context = FakeGrpcContext()
    assert asyncio.run(full.Generate(request, context)).choices[0].text == "t10t11"
    assert full.admission.in_flight == 0
