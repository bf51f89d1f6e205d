"""The Chat and ChatStream RPCs on the real ingress class over a scripted group
(tests/serve/fake_group.py's TextGroup): no Ray, so each call takes milliseconds.

What a request asks for is read off the `GroupRequest` the group receives; what comes back is
the group's fixed text read as the chat route reads it (tool calls whole, or streamed name first
then argument pieces). The real proxy's side is tests/serve/test_grpc.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest

from tandem.router import tandem_pb2 as pb
from tandem.router.grpc_service import RpcError
from tandem.router.tool_schema import forced_call_spec, required_calls_schema
from tandem.workers.structured.spec import StructuredSpec
from tests.serve.fake_group import MODEL, FakeGrpcContext, TextGroup, ingress_server, serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [pb.Tool(name="get_weather", description="The weather now", parameters=json.dumps(WEATHER)),
         pb.Tool(name="get_time")]
MESSAGES = [pb.ChatMessage(role="user", content="Weather in Oslo?")]
PROMPT_TOKENS = TextGroup.num_prompt_tokens
NAMED = pb.ToolChoice(function="get_weather")
REQUIRED = pb.ToolChoice(mode="required")
TWO_CALLS = ['[{"name": "get_time", "parameters": {}}, {"name": "get_wea', 'ther", "parameters": {"city": ',
             '"Oslo"}}]']


@pytest.fixture(scope="module")
def group() -> TextGroup:
    return TextGroup()


@pytest.fixture(scope="module")
def server(tiny_llama, group):
    # Each delta over its own call (no channel, which may join deltas that arrive together).
    server = ingress_server(tiny_llama, group, tool_call_parser="hermes", enable_auto_tool_choice=True,
                            stream_channels=False)
    with serving(server):
        yield server


def chat_request(**fields) -> pb.ChatRequest:
    return pb.ChatRequest(**{"messages": MESSAGES, "tools": TOOLS, **fields})


def chat(server, request: pb.ChatRequest, metadata: list | None = None) -> tuple[FakeGrpcContext, pb.ChatResponse]:
    context = FakeGrpcContext(metadata)
    return context, asyncio.run(server.Chat(request, context))


def chat_stream(server, request: pb.ChatRequest, metadata: list | None = None
                ) -> tuple[FakeGrpcContext, list[pb.ChatStreamResponse]]:
    context = FakeGrpcContext(metadata)

    async def consume() -> list[pb.ChatStreamResponse]:
        return [m async for m in server.ChatStream(request, context)]

    try:
        return context, asyncio.run(consume())
    except RpcError:  # a stream raises after setting its status
        return context, []


def stream_ids(messages: list[pb.ChatStreamResponse]) -> list[str]:
    """The calls' ids, in the order they were first sent; each cleared, so messages compare exactly."""
    ids = []
    for message in messages:
        for choice in message.choices:
            for call in choice.tool_calls:
                if call.id:
                    ids.append(call.id)
                    call.id = "id"
    return ids


def start(index: int, name: str) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=index, id="id", name=name)


def pieces(index: int, *arguments: str) -> list[pb.ToolCallDelta]:
    return [pb.ToolCallDelta(index=index, arguments=text) for text in arguments]


def usage(completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=completion_tokens,
                    total_tokens=PROMPT_TOKENS + completion_tokens)


# ---- forced calls ----------------------------------------------------------------------------------
def test_a_named_call_reaches_the_group_held_to_its_schema_and_comes_back_parsed(server, group) -> None:
    group.pieces = ['{"city": "Oslo"}']
    context, reply = chat(server, chat_request(tool_choice=NAMED, request_id="c-1"))
    assert context.code is None, context.details
    sent = group.calls[-1]
    assert sent.sampling.structured == StructuredSpec(
        "json", '{"type":"object","properties":{"city":{"type":"string","maxLength":8}},"required":["city"]}')
    assert (sent.sampling.max_tokens, sent.final_only) == (None, True)  # the chat route's default: the context
    [choice] = reply.choices
    [call] = choice.tool_calls
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    assert (reply.request_id, reply.model) == ("c-1", MODEL)
    assert choice == pb.ChatChoice(index=0, tool_calls=[pb.ToolCall(id=call.id, name="get_weather",
                                                                    arguments='{"city": "Oslo"}')],
                                   finish_reason="tool_calls", token_ids=[10])
    assert not choice.HasField("content")  # calls only: no content, as OpenAI's null
    assert reply.usage == usage(1)


def test_required_reaches_the_group_as_an_array_of_calls_and_comes_back_parsed(server, group) -> None:
    group.pieces = TWO_CALLS
    functions = [("get_weather", WEATHER), ("get_time", None)]
    for parallel, num_calls in ((True, 2), (False, 1)):
        context, reply = chat(server, chat_request(tool_choice=REQUIRED, parallel_tool_calls=parallel))
        assert context.code is None, context.details
        assert group.calls[-1].sampling.structured == forced_call_spec(required_calls_schema(functions, parallel))
        [choice] = reply.choices
        assert [(c.name, c.arguments) for c in choice.tool_calls] == [
            ("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')][:num_calls]
        assert len({c.id for c in choice.tool_calls}) == num_calls
        assert (choice.HasField("content"), choice.finish_reason, list(choice.token_ids)) == (
            False, "tool_calls", [10, 11, 12])
    assert reply.request_id.startswith("grpc-")  # no label: the server's own id


def test_a_streamed_named_call_sends_the_name_first_then_argument_pieces_per_choice(server, group) -> None:
    group.pieces = ['{"ci', 'ty": "Os', 'lo"}']
    context, messages = chat_stream(server, chat_request(tool_choice=NAMED, request_id="s-1",
                                                         sampling=pb.SamplingParams(n=2)))
    assert context.code is None, context.details
    ids = stream_ids(messages)
    assert len(ids) == 2 and ids[0] != ids[1]  # one call per choice, each its own id

    def choice(index: int, calls: list[pb.ToolCallDelta], token: int, finish_reason: str = "") -> pb.ChatChoiceDelta:
        return pb.ChatChoiceDelta(index=index, tool_calls=calls, token_ids=[token], finish_reason=finish_reason)

    def message(choices: list[pb.ChatChoiceDelta], **fields) -> pb.ChatStreamResponse:
        return pb.ChatStreamResponse(request_id="s-1", model=MODEL, choices=choices, **fields)

    first = [start(0, "get_weather"), *pieces(0, '{"ci')]
    assert messages == [
        message([choice(0, first, 10), choice(1, first, 10)]),
        message([choice(0, pieces(0, 'ty": "Os'), 11), choice(1, pieces(0, 'ty": "Os'), 11)]),
        message([choice(0, pieces(0, 'lo"}'), 12, "tool_calls"), choice(1, pieces(0, 'lo"}'), 12, "tool_calls")],
                finished=True, usage=usage(6))]
    assert group.calls[-1].final_only is False


def test_streamed_required_sends_each_call_name_first(server, group) -> None:
    group.pieces = TWO_CALLS
    context, messages = chat_stream(server, chat_request(tool_choice=REQUIRED))
    assert context.code is None, context.details
    assert len(set(stream_ids(messages))) == 2
    assert [list(m.choices[0].tool_calls) for m in messages] == [
        [start(0, "get_time"), *pieces(0, "{}")],  # "get_wea": the next call's name is not known yet
        [start(1, "get_weather"), *pieces(1, '{"city": ')],
        pieces(1, '"Oslo"}')]
    assert [m.choices[0].finish_reason for m in messages] == ["", "", "tool_calls"]
    assert [m.choices[0].content for m in messages] == ["", "", ""]


# ---- text and "auto" -------------------------------------------------------------------------------
def test_none_and_no_tools_give_text_unconstrained(server, group) -> None:
    group.pieces = ["It is ", "<tool_call>{oops</tool_call>"]
    for request in (chat_request(tool_choice=pb.ToolChoice(mode="none")), pb.ChatRequest(messages=MESSAGES)):
        context, reply = chat(server, request)
        assert context.code is None, context.details
        assert group.calls[-1].sampling.structured is None
        [choice] = reply.choices
        assert (choice.content, list(choice.tool_calls), choice.finish_reason) == (
            "It is <tool_call>{oops</tool_call>", [], "stop")
        context, messages = chat_stream(server, request)
        assert [(c.content, list(c.tool_calls), c.finish_reason) for m in messages for c in m.choices] == [
            ("It is ", [], ""), ("<tool_call>{oops</tool_call>", [], "stop")]


def test_auto_reads_the_families_syntax_whole_and_streamed(server, group) -> None:
    group.pieces = ["Let me check.<tool", '_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                    "\n</tool_call>"]
    context, reply = chat(server, chat_request())  # tools without a tool_choice: "auto"
    assert context.code is None, context.details
    [choice] = reply.choices
    assert (choice.content, [(c.name, c.arguments) for c in choice.tool_calls], choice.finish_reason) == (
        "Let me check.", [("get_weather", '{"city": "Oslo"}')], "tool_calls")
    assert group.calls[-1].sampling.structured is None
    context, messages = chat_stream(server, chat_request(tool_choice=pb.ToolChoice(mode="auto")))
    assert len(stream_ids(messages)) == 1
    assert [(c.content, list(c.tool_calls), c.finish_reason) for m in messages for c in m.choices] == [
        ("Let me check.", [], ""),  # "<tool" held back: it may open a call
        ("", [start(0, "get_weather"), *pieces(0, '{"city": "Oslo"}')], ""),
        ("", [], "tool_calls")]


def test_auto_without_a_parser_is_invalid_argument(tiny_llama) -> None:
    group = TextGroup()
    server = ingress_server(tiny_llama, group)
    details = ('tool_choice: "auto" (what tools without a tool_choice mean) needs a server started with '
               '--enable-auto-tool-choice and --tool-call-parser (hermes, llama3_json, mistral); send tool_choice '
               '"required", a named function or "none", or start the server with them')
    with serving(server):
        for request in (chat_request(), chat_request(tool_choice=pb.ToolChoice(mode="auto"))):
            for call in (chat, chat_stream):
                context, _ = call(server, request)
                assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert group.calls == []


# ---- the same path as the HTTP route ---------------------------------------------------------------
def test_a_conversation_reaches_the_group_as_the_http_route_sends_it(server, group, tiny_llama) -> None:
    """The same messages, tools and choice over both APIs: the same prompt (the template's
    rendering of the conversation, its earlier call included) and the same sampling."""
    group.pieces = ['{"city": "Bergen"}']
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = {"model": MODEL, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                                        "parameters": WEATHER}},
                      {"type": "function", "function": {"name": "get_time"}}],
            "messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}],
            "temperature": 0.5, "max_completion_tokens": 4}
    with serving(server) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    over_http = group.calls[-1]
    messages = [MESSAGES[0], pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
                    id="call_1", name="get_weather", arguments='{"city": "Oslo"}')]),
                pb.ChatMessage(role="tool", content="12 C", tool_call_id="call_1")]
    context, reply = chat(server, chat_request(messages=messages, tool_choice=NAMED, model=MODEL,
                                               sampling=pb.SamplingParams(temperature=0.5, max_tokens=4)))
    assert context.code is None, context.details
    assert reply.choices[0].tool_calls[0].arguments == '{"city": "Bergen"}'
    over_grpc = group.calls[-1]
    assert over_grpc.prompt_token_ids == over_http.prompt_token_ids
    assert over_grpc.sampling == over_http.sampling
    assert dataclasses.replace(over_grpc, request_id="", sampling=None) == dataclasses.replace(
        over_http, request_id="", sampling=None)


# ---- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, details", [
    ({"tools": [pb.Tool(name="get weather")]},
     "tools.0.name: String should match pattern '^[a-zA-Z0-9_-]{1,64}$'"),
    ({"tools": [pb.Tool(name="f", parameters="{oops")]},
     "tools.0.parameters: invalid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ({"tools": [pb.Tool(name="f", parameters="[]")]}, "tools.0.parameters: the schema must be a JSON object"),
    ({"tools": [pb.Tool(name="f", parameters='{"a": NaN}')]},
     "tools.0.parameters: invalid JSON: NaN is not a JSON number"),
    ({"tools": [pb.Tool(name="f", parameters='{"type": "string"}')]},
     "tools: the parameters of 'f' must be a JSON schema of type 'object', got type 'string'"),
    ({"tools": [pb.Tool(name="f"), pb.Tool(name="f")]}, "tools: the function 'f' is given twice"),
    ({"tool_choice": pb.ToolChoice(function="g")},
     "tool_choice: the function 'g' is not among the tools (get_weather, get_time)"),
    ({"tool_choice": pb.ToolChoice(mode="sometimes")},
     "tool_choice.mode: must be \"none\", \"auto\" or \"required\", got 'sometimes'"),
    ({"tools": [], "tool_choice": REQUIRED}, "tool_choice: 'required' needs tools (none were given)"),
    ({"tool_choice": REQUIRED, "sampling": pb.SamplingParams(regex="[ab]+")},
     "tool_choice: a forced tool call (required) cannot be combined with regex: it sets the output's structure "
     "itself"),
    ({"messages": []}, "messages: List should have at least 1 item after validation, not 0"),
    ({"messages": [pb.ChatMessage(role="robot", content="hi")]},
     "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ({"messages": [MESSAGES[0], pb.ChatMessage(role="tool", content="12 C")]},
     "messages: message 1 (tool) needs the 'tool_call_id' of the call it answers"),
    ({"messages": [MESSAGES[0], pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
        id="c", name="f", arguments="[1]")])]},
     "messages: message 1's tool call 0 ('f') has arguments that are not the text of a JSON object"),
    ({"messages": [pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(id="c", name="f", arguments="{}")])]},
     "messages: message 0 (user) has tool_calls; only an assistant's message carries them"),
], ids=["name", "not-json", "not-object", "nan", "not-object-schema", "twice", "unknown-choice", "bad-mode",
        "no-tools", "with-regex", "no-messages", "role", "no-call-id", "bad-arguments", "user-calls"])
def test_bad_tools_and_messages_are_invalid_argument_naming_the_field(server, group, fields, details) -> None:
    before = len(group.calls)
    for call in (chat, chat_stream):
        context, _ = call(server, chat_request(**fields))
        assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert len(group.calls) == before  # no group ever saw it


def test_the_key_an_unknown_model_and_overload_answer_as_generate_does(tiny_llama) -> None:
    server = ingress_server(tiny_llama, TextGroup(), admission={"max_requests_per_group": 1, "retry_after_s": 3},
                            api_key="sesame")
    key = [("authorization", "Bearer sesame")]
    with serving(server):
        for call in (chat, chat_stream):
            context, _ = call(server, chat_request(tool_choice=NAMED), [("authorization", "Bearer nope")])
            assert (context.code, context.details) == (grpc.StatusCode.UNAUTHENTICATED,
                                                       "authorization: invalid API key")
        context, _ = chat(server, chat_request(model="gpt-17"), key)
        assert (context.code, context.details) == (
            grpc.StatusCode.NOT_FOUND, "model: 'gpt-17' is not served here; this server serves 'tiny'")
        server.admission.in_flight = 1
        full = "overloaded: 1 requests in flight, at most 1 for 1 replica group(s)"
        for call in (chat, chat_stream):
            context, _ = call(server, chat_request(tool_choice=NAMED), key)
            assert (context.code, context.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, full)
            assert context.trailing == [("retry-after", "3")]
        assert server.admission.in_flight == 1
        server.admission.in_flight = 0
