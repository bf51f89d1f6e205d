"""hypothesis over the gRPC request messages: any GenerateRequest / TokenizeRequest the proto
can carry gets OK or a client status (INVALID_ARGUMENT, NOT_FOUND), never INTERNAL.

The requests go through GrpcMethods on the real ingress class over a fake group
(tests/serve/fake_group.py), in process: hundreds of them take a few seconds.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tandem.router import tandem_pb2 as pb
from tests.serve.fake_group import MODEL, EchoGroup, FakeGrpcContext, ingress_server, serving

UINT32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 70)  # around the test model's context (64) and n's bound
FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3.0, 3.0)
FLOAT32 = st.floats(-101.0, 101.0, width=32)  # logit_bias: around its bounds, [-100, 100]
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
NUM_GENERATE, NUM_TOKENIZE = 600, 150


def _optional(strategy):
    return st.none() | strategy


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    fields = {
        "max_tokens": draw(_optional(SMALL | UINT32)), "temperature": draw(_optional(FLOAT)),
        "top_p": draw(_optional(FLOAT)), "top_k": draw(_optional(st.integers(-2**31, 2**31 - 1) | st.integers(-3, 3))),
        "min_p": draw(_optional(FLOAT)), "n": draw(_optional(st.integers(0, 4) | UINT32)),
        "seed": draw(_optional(st.integers(-2**63, 2**63 - 1))),
        "presence_penalty": draw(_optional(FLOAT)), "frequency_penalty": draw(_optional(FLOAT)),
        "repetition_penalty": draw(_optional(FLOAT)), "logprobs": draw(_optional(st.integers(0, 25) | UINT32)),
        "min_tokens": draw(_optional(SMALL | UINT32)), "skip_special_tokens": draw(_optional(st.booleans())),
    }
    proto = pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    proto.stop.extend(draw(st.lists(st.text(max_size=30), max_size=20)))
    proto.stop_token_ids.extend(draw(st.lists(SMALL | UINT32, max_size=10)))
    proto.ignore_eos = draw(st.booleans())
    proto.include_stop_str_in_output = draw(st.booleans())
    structured = draw(st.sampled_from(["none", "none", "json_schema", "json_object", "regex", "choice", "grammar"]))
    if structured == "json_schema":
        proto.json_schema = draw(st.sampled_from(['{"type": "object"}', '{"type": "nope"}', "[]"])
                                 | st.text(max_size=30))
    elif structured == "json_object":
        proto.json_object = draw(st.booleans())
    elif structured == "regex":
        proto.regex = draw(st.sampled_from(["[ab]+", "(", "[^\\x00-\\U0010FFFF]"]) | st.text(max_size=20))
    elif structured == "choice":
        proto.choice.choices.extend(draw(st.lists(st.text(max_size=8), max_size=3)))
    elif structured == "grammar":
        proto.grammar = draw(st.sampled_from(['root ::= "a"', "root ::= foo"]) | st.text(max_size=30))
    for token, bias in draw(st.dictionaries(st.integers(-2**31, 2**31 - 1) | SMALL, st.floats(width=32) | FLOAT32,
                                            max_size=4)).items():
        proto.logit_bias[token] = bias
    return proto


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model=draw(st.sampled_from(["", "", MODEL, MODEL, "other", "\u00e9\u0000"])),
                                 request_id=draw(st.text(max_size=20)))
    prompt = draw(st.sampled_from(["none", "text", "ids"]))
    if prompt == "text":
        request.text = draw(st.text(max_size=80))
    elif prompt == "ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, 600) | UINT32, max_size=70)))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_params()))
    return request


@pytest.fixture(scope="module")
def server(tiny_llama):
    server = ingress_server(tiny_llama, EchoGroup(), admission={"max_requests_per_group": 64})
    with serving(server):
        yield server


def test_generated_grpc_requests_never_fail_internally(server):
    codes: Counter[str] = Counter()

    @seed(18)
    @given(request=generate_requests(), streaming=st.booleans())
    @settings(max_examples=NUM_GENERATE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def generate(request: pb.GenerateRequest, streaming: bool) -> None:
        context = FakeGrpcContext()
        if streaming:
            async def consume() -> list:
                return [m async for m in server.GenerateStream(request, context)]

            try:
                messages = asyncio.run(consume())
            except Exception:  # noqa: BLE001 - a streaming method raises after setting its status
                messages = []
            assert context.code is None or messages == []
        else:
            reply = asyncio.run(server.Generate(request, context))
            assert context.code is not None or len(reply.choices) >= 1
        assert context.code is None or context.code in CLIENT_CODES, (context.code, context.details)
        codes[context.code.name if context.code else "OK"] += 1

    @seed(18)
    @given(request=st.builds(pb.TokenizeRequest, model=st.sampled_from(["", MODEL, "other"]),
                             text=st.text(max_size=200), add_special_tokens=st.booleans()))
    @settings(max_examples=NUM_TOKENIZE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def tokenize(request: pb.TokenizeRequest) -> None:
        context = FakeGrpcContext()
        reply = asyncio.run(server.Tokenize(request, context))
        assert context.code in (None, grpc.StatusCode.NOT_FOUND), context.details
        assert context.code is not None or reply.count == len(reply.token_ids)
        codes[context.code.name if context.code else "OK"] += 1

    generate()
    tokenize()
    total = sum(codes.values())
    print(f"hypothesis gRPC: {total} requests, by status {dict(sorted(codes.items()))}")
    assert total == NUM_GENERATE + NUM_TOKENIZE
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0 and "INTERNAL" not in codes
    assert server.admission.in_flight == 0
