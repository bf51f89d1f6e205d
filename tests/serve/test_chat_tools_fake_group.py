"""Tool calls through the HTTP layer over a scripted group: no Ray, so fast and exact.

The group answers with a chosen text, cut into chosen deltas, for every choice: what a real
model would write for a tool call, which the random-weight test models never do on demand.
"""

from __future__ import annotations

import json

import pytest

from tests.serve.fake_group import TextGroup, ingress_server, serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
PROMPT_TOKENS = TextGroup.num_prompt_tokens


@pytest.fixture(scope="module")
def group() -> TextGroup:
    return TextGroup()


@pytest.fixture(scope="module")
def client(tiny_llama, group):
    # Each delta over its own call (no channel, which may join deltas that arrive together), so
    # the chunks below are the deltas as scripted.
    server = ingress_server(tiny_llama, group, tool_call_parser="hermes", enable_auto_tool_choice=True,
                            stream_channels=False)
    with serving(server) as http:
        yield http


def chat(client, **fields) -> dict:
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def chunks(client, **fields) -> list[dict]:
    response = client.post("/v1/chat/completions",
                           json={"messages": MESSAGES, "tools": TOOLS, "stream": True, **fields})
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def deltas(events: list[dict]) -> list[tuple]:
    """(index, delta, finish_reason) of each choice chunk, the call ids replaced by their order."""
    ids: dict[str, str] = {}
    out = []
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            for call in delta.get("tool_calls") or ():
                if "id" in call:
                    call["id"] = ids.setdefault(call["id"], f"id{len(ids)}")
            out.append((choice["index"], delta, choice["finish_reason"]))
    return out


def test_a_named_call_streamed_name_first_then_argument_pieces_for_each_of_n_choices(client, group):
    group.pieces = ['{"ci', 'ty": "Os', 'lo"}']
    events = chunks(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=2,
                    stream_options={"include_usage": True})
    start = {"role": None, "content": None}
    assert deltas(events) == [
        (0, {"role": "assistant", "content": None}, None),
        (1, {"role": "assistant", "content": None}, None),
        (0, {**start, "tool_calls": [{"index": 0, "id": "id0", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}, None),
        (0, {**start, "tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}, None),
        (1, {**start, "tool_calls": [{"index": 0, "id": "id1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}, None),
        (1, {**start, "tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}, None),
        (0, {**start, "tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Os'}}]}, None),
        (1, {**start, "tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Os'}}]}, None),
        (0, {**start, "tool_calls": [{"index": 0, "function": {"arguments": 'lo"}'}}]}, "tool_calls"),
        (1, {**start, "tool_calls": [{"index": 0, "function": {"arguments": 'lo"}'}}]}, "tool_calls")]
    assert events[-1]["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 6,
                                   "total_tokens": PROMPT_TOKENS + 6, "prompt_tokens_details": {"cached_tokens": 0}}
    structured = group.calls[-1].sampling.structured
    assert (structured.kind, json.loads(structured.value)) == ("json", WEATHER)


def test_required_whole_and_streamed(client, group):
    group.pieces = ['[{"name": "get_time", "parameters": {}}, {"name": "get_wea', 'ther", "parameters": {"city": ',
                    '"Oslo"}}]']
    body = chat(client, tool_choice="required")
    [choice] = body["choices"]
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_time", "arguments": "{}"}),
        ("function", {"name": "get_weather", "arguments": '{"city": "Oslo"}'})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert (choice["message"]["content"], choice["finish_reason"]) == (None, "tool_calls")
    assert body["usage"]["completion_tokens"] == 3
    start = {"role": None, "content": None}
    assert deltas(chunks(client, tool_choice="required")) == [
        (0, {"role": "assistant", "content": None}, None),
        (0, {**start, "tool_calls": [{"index": 0, "id": "id0", "type": "function",
                                      "function": {"name": "get_time", "arguments": ""}}]}, None),
        (0, {**start, "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, None),
        (0, {**start, "tool_calls": [{"index": 1, "id": "id1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}, None),
        (0, {**start, "tool_calls": [{"index": 1, "function": {"arguments": '{"city": '}}]}, None),
        (0, {**start, "tool_calls": [{"index": 1, "function": {"arguments": '"Oslo"}'}}]}, "tool_calls")]


def test_auto_reads_the_families_syntax_and_never_streams_a_calls_text(client, group):
    group.pieces = ["Let me check.<tool", '_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                    "\n</tool_call>"]
    [choice] = chat(client)["choices"]
    assert choice["message"]["content"] == "Let me check."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert choice["finish_reason"] == "tool_calls"
    start = {"role": None, "content": None}
    assert deltas(chunks(client)) == [
        (0, {"role": "assistant", "content": ""}, None),  # "auto" may answer text: content starts as ""
        (0, {"role": None, "content": "Let me check."}, None),
        (0, {**start, "tool_calls": [{"index": 0, "id": "id0", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}, None),
        (0, {**start, "tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}, None),
        (0, start, "tool_calls")]
    assert group.calls[-1].sampling.structured is None


def test_auto_text_without_calls_and_none_are_plain_replies(client, group):
    group.pieces = ["It is ", "<tool_call>{oops</tool_call>"]
    for fields in ({}, {"tool_choice": "none"}):
        [choice] = chat(client, **fields)["choices"]
        assert choice["message"] == {"role": "assistant", "content": "It is <tool_call>{oops</tool_call>"}
        assert choice["finish_reason"] == "stop"
    assert [d[1]["content"] for d in deltas(chunks(client, tool_choice="none"))] == [
        "", "It is ", "<tool_call>{oops</tool_call>"]


def test_the_prompt_shows_the_tools_and_the_conversations_calls(client, group):
    group.pieces = ["ok"]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat(client, tool_choice="none", messages=MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}])
    # The tiny model's template writes roles and contents only (it ignores tools, as many do).
    from tandem.workers.text.tokenizer import load_tokenizer
    from tests.conftest import tiny_model

    text = load_tokenizer(tiny_model("llama")).decode(group.calls[-1].prompt_token_ids)
    assert text == ("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
                    "<|im_start|>tool\n12 C<|im_end|>\n<|im_start|>assistant\n")


def test_refusals_over_http(client):
    def error(**fields) -> tuple[int, dict]:
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
        return response.status_code, response.json()["error"]

    status, body = error(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert (status, body["param"]) == (400, "tool_choice")
    status, body = error(functions=[{"name": "f"}])
    assert (status, body["param"], body["message"]) == (
        400, "functions", "functions: deprecated by OpenAI and not supported; send tools and tool_choice")
