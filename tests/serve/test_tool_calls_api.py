"""Tool calls and structured outputs end to end: the official `openai` client against a running
app on a random-weight model, whose tokens are arbitrary: only the engine's constraint makes a
forced call's arguments (or a parsed response_format) parse, so they are checked against the
schema with jsonschema (or the client's own model).

Every value of the tools' schemas is bounded (an enum, an integer range, a string's length), so
a forced call always ends within max_tokens. One application, a handful of requests.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.conftest import serve_app

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

MODEL = "tiny"
MAX_TOKENS = 120
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(shared_ray, tiny_llama):
    # No tool-call parser: "auto" is refused (below), forced calls need none.
    args = {"model": tiny_llama, "served_model_name": MODEL, "max_model_len": 256, "num_kv_blocks": 64,
            "block_size": 16}
    with serve_app(args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def check_calls(calls, names: set[str]) -> None:
    """Each call is OpenAI's shape, names one of `names`, and its arguments validate."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_call_whole(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                         max_tokens=MAX_TOKENS)
    [choice] = out.choices
    assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert out.usage.completion_tokens > 0


def test_a_named_call_streamed_as_openai_streams_it(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                                 max_tokens=MAX_TOKENS, stream=True))
    pieces = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or ()]
    first = pieces[0]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", "get_weather", "")
    assert first.id.startswith("call_")
    assert all((p.index, p.id, p.type, p.function.name) == (0, None, None, None) for p in pieces[1:])
    arguments = "".join(p.function.arguments for p in pieces[1:])
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_required_for_two_choices_whole_and_streamed(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, n=2, max_tokens=MAX_TOKENS)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert (choice.message.content, choice.finish_reason, len(choice.message.tool_calls)) == (
            None, "tool_calls", 1)
        check_calls(choice.message.tool_calls, set(SCHEMAS))
    # The client's own stream accumulator puts the pieces together as it would OpenAI's.
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=MAX_TOKENS) as stream:
        final = stream.get_final_completion()
    [choice] = final.choices
    assert (choice.message.content, choice.finish_reason, len(choice.message.tool_calls)) == (None, "tool_calls", 1)
    check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_tool_choice_none_answers_text(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    [choice] = out.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert (choice.finish_reason, out.usage.completion_tokens) == ("length", 8)


def test_auto_without_a_parser_is_a_400_saying_how_to_enable_it(client):
    for tool_choice in ("auto", openai.NOT_GIVEN):  # tools alone mean "auto"
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=8)
        error = caught.value.body
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice and --tool-call-parser" in error["message"]


def test_parse_gives_the_clients_model_whole_and_streamed_for_two_choices(client):
    """`client.chat.completions.parse(response_format=Model)`: OpenAI's strict json_schema, held
    while decoding, so every choice parses into the model (the random weights alone never would)."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: Annotated[str, Field(max_length=6)]
        unit: Literal["c", "f"]
        days: Annotated[int, Field(ge=1, le=7)]

    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Forecast, n=2,
                                        temperature=1.0, max_tokens=MAX_TOKENS)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(isinstance(c.message.parsed, Forecast) and c.finish_reason == "stop" for c in out.choices)
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=Forecast, n=2,
                                        temperature=1.0, max_tokens=MAX_TOKENS) as stream:
        final = stream.get_final_completion()
    assert [c.index for c in final.choices] == [0, 1]
    assert all(isinstance(c.message.parsed, Forecast) for c in final.choices)
