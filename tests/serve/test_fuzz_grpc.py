"""hypothesis over the gRPC request messages: any GenerateRequest / ChatRequest / TokenizeRequest
the proto can carry gets OK or a client status (INVALID_ARGUMENT, NOT_FOUND), never INTERNAL.

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
NUM_GENERATE, NUM_CHAT, NUM_TOKENIZE = 600, 300, 150
TOOL_NAMES = ("get_weather", "get_time")
OBJECT = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
NAMES = st.sampled_from([*TOOL_NAMES, "bad name", "", "\u00fc", "x" * 65]) | st.text(max_size=8)
PARAMETERS = st.sampled_from([OBJECT, "", "[]", "{oops", '{"type": "string"}', '{"a": NaN}',
                              '{"a":' * 40 + "1" + "}" * 40, '{"$ref": "#/$defs/x", "$defs": {"x": {"type": "object"}}}'
                              ]) | st.text(max_size=30)


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


@st.composite
def chat_requests(draw) -> pb.ChatRequest:
    """A valid request with at most one part drawn from anything the proto can carry: most get past
    the checks, to the tool plan, the template and the reply."""
    wild = draw(st.sampled_from(["nothing", "nothing", "messages", "tools", "tool_choice", "sampling", "model"]))
    request = pb.ChatRequest(request_id=draw(st.text(max_size=20)))
    if wild == "model":
        request.model = draw(st.sampled_from([MODEL, "other", "\u00e9\u0000"]))
    if wild == "messages":
        request.messages.extend(draw(st.lists(wild_messages(), max_size=2)))  # the test model's context is 64
    else:
        request.messages.add(role="user", content=draw(st.text(max_size=20)))
    if wild == "tools":
        for name in draw(st.lists(NAMES, max_size=3)):
            tool = request.tools.add(name=name, parameters=draw(PARAMETERS))
            if draw(st.booleans()):
                tool.description = draw(st.text(max_size=20))
    else:
        for name in draw(st.lists(st.sampled_from(TOOL_NAMES), max_size=2, unique=True)):
            request.tools.add(name=name, parameters=draw(st.sampled_from([OBJECT, ""])))
    names = [tool.name for tool in request.tools]
    choices = ["unset", "none"] + (["auto", "required", "function"] if names else [])
    choice = draw(st.sampled_from(choices + ["empty", "sometimes"] if wild == "tool_choice" else choices))
    if choice == "empty":
        request.tool_choice.SetInParent()
    elif choice == "function":
        request.tool_choice.function = draw(NAMES if wild == "tool_choice" else st.sampled_from(names))
    elif choice != "unset":
        request.tool_choice.mode = choice
    if draw(st.booleans()):
        request.parallel_tool_calls = draw(st.booleans())
    if wild == "sampling":
        request.sampling.CopyFrom(draw(sampling_params()))
    else:
        request.sampling.n = draw(st.integers(1, 2))
    return request


@st.composite
def wild_messages(draw) -> pb.ChatMessage:
    message = pb.ChatMessage(role=draw(st.sampled_from(["user", "assistant", "tool", "system", "x", ""])))
    if draw(st.booleans()):
        message.content = draw(st.text(max_size=20))
    if draw(st.booleans()):
        message.tool_call_id = draw(st.text(max_size=8))
    if draw(st.booleans()):
        message.tool_calls.add(id=draw(st.text(max_size=8)), name=draw(NAMES),
                               arguments=draw(st.sampled_from(["{}", '{"a": 1}', "[1]", "{", "[" * 2000])))
    return message


@pytest.fixture(scope="module")
def server(tiny_llama):
    server = ingress_server(tiny_llama, EchoGroup(), admission={"max_requests_per_group": 64},
                            tool_call_parser="hermes", enable_auto_tool_choice=True)
    with serving(server):
        yield server


def test_generated_grpc_requests_never_fail_internally(server):
    codes: Counter[str] = Counter()
    chat_codes: Counter[str] = Counter()

    def call(whole, stream, request, streaming: bool) -> str:
        """One request, whole or streamed: its status, which is OK or a client's error, and an
        answer exactly when it is OK."""
        context = FakeGrpcContext()
        if streaming:
            async def consume() -> list:
                return [m async for m in stream(request, context)]

            try:
                messages = asyncio.run(consume())
            except Exception:  # noqa: BLE001 - a streaming method raises after setting its status
                messages = []
            assert context.code is None or messages == []
        else:
            reply = asyncio.run(whole(request, context))
            assert context.code is not None or len(reply.choices) >= 1
        assert context.code is None or context.code in CLIENT_CODES, (context.code, context.details)
        return context.code.name if context.code else "OK"

    @seed(18)
    @given(request=generate_requests(), streaming=st.booleans())
    @settings(max_examples=NUM_GENERATE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def generate(request: pb.GenerateRequest, streaming: bool) -> None:
        codes[call(server.Generate, server.GenerateStream, request, streaming)] += 1

    @seed(18)
    @given(request=chat_requests(), streaming=st.booleans())
    @settings(max_examples=NUM_CHAT, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def chat(request: pb.ChatRequest, streaming: bool) -> None:
        code = call(server.Chat, server.ChatStream, request, streaming)
        codes[code] += 1
        chat_codes[code] += 1

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
    chat()
    tokenize()
    total = sum(codes.values())
    print(f"hypothesis gRPC: {total} requests, by status {dict(sorted(codes.items()))}; Chat's "
          f"{dict(sorted(chat_codes.items()))}")
    assert total == NUM_GENERATE + NUM_CHAT + NUM_TOKENIZE
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0 and "INTERNAL" not in codes
    assert chat_codes["OK"] > 0 and chat_codes["INVALID_ARGUMENT"] > 0
    assert server.admission.in_flight == 0
