"""A chat request's tool fields: the 400s that name them, and what each tool_choice makes of the
prompt, the decoding and the reply (router/tool_request.py, router/chat_tools.py)."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from tandem.router.chat_tools import ToolCalling, template_message, tool_call_options
from tandem.router.protocol import ChatCompletionRequest, OpenAIError
from tandem.workers.structured.spec import StructuredSpec
from tests.conftest import tiny_model

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def refusal(**fields) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    error = OpenAIError.from_validation(caught.value).body.error
    return error.message, error.param


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.workers.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model("llama"))


def test_refusals_name_the_field():
    function = {"type": "function", "function": {"name": "g"}}
    assert refusal(tools=TOOLS, tool_choice="maybe") == (
        "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        "tool_choice")
    assert refusal(tools=TOOLS, tool_choice=function) == (
        "tool_choice: the function 'g' is not among the tools (get_weather, get_time)", "tool_choice")
    assert refusal(tool_choice="required") == ("tool_choice: 'required' needs tools (none were given)", "tool_choice")
    assert refusal(tools=[], tool_choice=function) == (
        "tool_choice: the function 'g' needs tools (none were given)", "tool_choice")
    assert refusal(tools=TOOLS + TOOLS[:1]) == ("tools: the function 'get_weather' is given twice", "tools")
    assert refusal(tools=[TOOLS[1]] * 129) == ("tools: List should have at most 128 items after validation, not 129",
                                               "tools")
    assert refusal(tools=[{"type": "function", "function": {"name": "a b"}}]) == (
        "tools.0.function.name: String should match pattern '^[a-zA-Z0-9_-]{1,64}$'", "tools")
    assert refusal(tools=[{"type": "custom", "custom": {"name": "a"}}]) == (
        "tools.0.type: Input should be 'function'", "tools")
    assert refusal(tools=[{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]) == (
        "tools: the parameters of 'a' must be a JSON schema of type 'object', got type 'array'", "tools")
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer", "description": "x" * 100} for i in range(700)}}
    size = len(json.dumps(big))
    assert refusal(tools=[{"type": "function", "function": {"name": "a", "parameters": big}}]) == (
        f"tools: the functions' parameters are {size} characters of JSON; at most 65536 are accepted", "tools")
    assert refusal(functions=[{"name": "a"}]) == (
        "functions: deprecated by OpenAI and not supported; send tools and tool_choice", "functions")
    assert refusal(function_call="auto") == (
        "function_call: deprecated by OpenAI and not supported; send tools and tool_choice", "function_call")


def test_the_messages_tool_parts_are_checked():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert refusal(messages=[{"role": "tool", "content": "12 C"}]) == (
        "messages: message 0 (tool) needs the 'tool_call_id' of the call it answers", "messages")
    assert refusal(messages=[{"role": "user", "content": "x", "tool_calls": [call]}]) == (
        "messages: message 0 (user) has tool_calls; only an assistant's message carries them", "messages")
    broken = {**call, "function": {"name": "get_weather", "arguments": "Oslo"}}
    assert refusal(messages=[{"role": "assistant", "content": None, "tool_calls": [broken]}]) == (
        "messages: message 0's tool call 0 ('get_weather') has arguments that are not the text of a JSON object",
        "messages")
    req = request(messages=MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}])
    assert [template_message(m) for m in req.messages] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]


def test_tool_modes():
    assert request().tool_mode is None
    assert request(tools=TOOLS).tool_mode == "auto"  # OpenAI's default when tools are given
    assert request(tools=[], tool_choice="none").tool_mode is None
    assert request(tools=TOOLS, tool_choice="none").tool_mode == "none"
    assert request(tools=TOOLS, tool_choice="required").tool_mode == "required"
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tool_mode == "named" and named.parallel_calls
    assert not request(tools=TOOLS, parallel_tool_calls=False).parallel_calls


def test_auto_without_a_parser_says_how_to_turn_it_on(tokenizer):
    for calling in (ToolCalling(tokenizer), ToolCalling(tokenizer, "hermes", enable_auto_tool_choice=False)):
        with pytest.raises(ValueError) as caught:
            calling.plan(request(tools=TOOLS))
        assert str(caught.value) == (
            'tool_choice: "auto" (what tools without a tool_choice mean) needs a server started with '
            '--enable-auto-tool-choice and --tool-call-parser (hermes, llama3_json, mistral); send tool_choice '
            '"required", a named function or "none", or start the server with them')


def test_plans(tokenizer):
    calling = ToolCalling(tokenizer, "hermes", enable_auto_tool_choice=True)
    rendered = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                                  "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                     "properties": {}}}}]
    none = calling.plan(request(tools=TOOLS, tool_choice="none"))  # vLLM's default: shown, never read
    assert (none.template_tools, none.structured, none.reads_calls) == (rendered, None, False)
    auto = calling.plan(request(tools=TOOLS))
    sampling = {"n": 1}
    auto.adjust(sampling)
    assert (auto.template_tools, auto.structured, auto.reads_calls, sampling) == (rendered, None, True, {"n": 1})
    named = calling.plan(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    named.adjust(sampling)
    assert sampling == {"n": 1, "structured": StructuredSpec("json", json.dumps(WEATHER, separators=(",", ":")))}
    required = calling.plan(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert json.loads(required.structured.value)["maxItems"] == 1
    assert calling.plan(request()).template_tools is None
    with pytest.raises(ValueError, match=r"^tool_choice: a forced tool call \(required\) cannot be combined with "
                                         r"response_format: it sets the output's structure itself$"):
        calling.plan(request(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}))


def test_replies_of_each_mode(tokenizer):
    calling = ToolCalling(tokenizer, "hermes", enable_auto_tool_choice=True)
    auto = calling.plan(request(tools=TOOLS, parallel_tool_calls=False))
    content, calls = auto.choice().parse('Hm.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
                                         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "Hm." and [(c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("function", "get_time", "{}")]  # parallel_tool_calls false: the first only
    named = calling.plan(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    content, [call] = named.choice().parse('{"city": "Oslo"}')
    assert (content, call.function.name, call.function.arguments) == (None, "get_weather", '{"city": "Oslo"}')
    assert call.id.startswith("call_") and len(call.id) == 29
    assert (named.finish_reason("stop", True), named.finish_reason("length", True),
            named.finish_reason("stop", False)) == ("tool_calls", "length", "stop")
    reader = named.choice()
    first, second = [d.model_dump() for d in reader.deltas('{"ci', last=False)]
    call_id = first["tool_calls"][0]["id"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id)
    assert first == {"role": None, "content": None, "tool_calls": [
        {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}
    assert second == {"role": None, "content": None, "tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert [d.model_dump() for d in reader.deltas('ty": "Oslo"}', last=True)] == [
        {"role": None, "content": None, "tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]
    assert reader.num_calls == 1


def test_a_marker_that_is_a_special_token_keeps_special_tokens_and_cuts_the_end_of_sequence(tokenizer):
    from tandem.workers.text.tokenizer import load_tokenizer

    assert not ToolCalling(tokenizer, "mistral", True).keeps_special_tokens  # "[TOOL_CALLS]" is plain text here
    special = load_tokenizer(tiny_model("llama"))
    special.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    calling = ToolCalling(special, "mistral", enable_auto_tool_choice=True)
    plan = calling.plan(request(tools=TOOLS))
    sampling: dict = {}
    plan.adjust(sampling)
    assert sampling == {"skip_special_tokens": False}
    eos = special.eos_token_id
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]<|eos|>'
    assert plan.output_text(text, [7, eos], "stop", None) == text.removesuffix("<|eos|>")
    assert plan.output_text(text, [7, eos], "length", None) == text
    assert plan.output_text(text, [7, eos], "stop", "</s>") == text  # a stop string is not in the text
    assert plan.output_text(text, [7, 8], "stop", None) == text  # not a special token
    assert plan.choice().parse(plan.output_text(text, [7, eos], "stop", None))[0] is None
    assert calling.plan(request(tools=TOOLS, tool_choice="none")).keeps_special_tokens is False


def test_serving_options():
    assert tool_call_options({}) == {"tool_call_parser": None, "enable_auto_tool_choice": False}
    assert tool_call_options({"tool_call_parser": "mistral", "enable_auto_tool_choice": True}) == {
        "tool_call_parser": "mistral", "enable_auto_tool_choice": True}
    with pytest.raises(ValueError, match=r"^enable_auto_tool_choice: needs tool_call_parser \(hermes, llama3_json, "
                                         r"mistral\)$"):
        tool_call_options({"enable_auto_tool_choice": True})
    with pytest.raises(ValueError, match=r"^tool_call_parser: must be one of hermes, llama3_json, mistral, got 'x'$"):
        tool_call_options({"tool_call_parser": "x"})
    with pytest.raises(ValueError, match=r"^enable_auto_tool_choice: must be true or false, got 'yes'$"):
        tool_call_options({"tool_call_parser": "hermes", "enable_auto_tool_choice": "yes"})


def test_the_command_line_flags():
    from tandem.cli.main import build_parser, engine_options
    from tandem.cli.serve import app_args

    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"])
    options = app_args(args, engine_options(args))
    assert (options["tool_call_parser"], options["enable_auto_tool_choice"]) == ("llama3_json", True)
    plain = build_parser().parse_args(["serve"])
    assert "tool_call_parser" not in app_args(plain, engine_options(plain))
