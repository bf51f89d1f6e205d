"""Each family's tool-call parser on fixed texts: whole, and streamed cut at every point."""

from __future__ import annotations

import re

import pytest

from tandem.router.tool_parsers.call_stream import CallArguments, CallStart, Content, ParsedCall, collect
from tandem.router.tool_parsers.forced import REQUIRED, NamedCallStream
from tandem.router.tool_parsers.hermes import HERMES
from tandem.router.tool_parsers.llama3_json import LLAMA3_JSON
from tandem.router.tool_parsers.mistral import MISTRAL, mistral_call_id
from tandem.router.tool_parsers.registry import TOOL_PARSERS, tool_parser

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
TIME = ParsedCall("get_time", "{}")

# (parser, text, content, calls): what parse() gives for the whole text.
CASES = {
    "hermes one call": (
        HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        None, [WEATHER]),
    "hermes two calls": (
        HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        None, [WEATHER, TIME]),
    "hermes content before": (
        HERMES, 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
                '</tool_call>',
        "Let me look.\n", [WEATHER]),
    "hermes no closing tag": (
        HERMES, '<tool_call>{"name": "get_time"}', None, [TIME]),
    "hermes malformed json": (
        HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', []),
    "hermes no name": (
        HERMES, '<tool_call>{"nam": "get_time", "arguments": {}}</tool_call>',
        '<tool_call>{"nam": "get_time", "arguments": {}}</tool_call>', []),
    "hermes cut short": (
        HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', []),
    "hermes text after": (
        HERMES, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone <tool',
        "\nDone <tool", [TIME]),
    "hermes plain text": (
        HERMES, "a < b, and <tool is not a tag", "a < b, and <tool is not a tag", []),
    "llama3 one call": (
        LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [WEATHER]),
    "llama3 two calls": (
        LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                     '{"name": "get_time", "parameters": {}}',
        None, [WEATHER, TIME]),
    "llama3 python tag after content": (
        LLAMA3_JSON, 'Checking.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        "Checking.", [WEATHER]),
    "llama3 malformed": (
        LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3]}',
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3]}', []),
    "llama3 brace in prose": (
        LLAMA3_JSON, 'Use {"name": "x"} here', 'Use {"name": "x"} here', []),
    "llama3 json that is no call": (
        LLAMA3_JSON, ' {"answer": 42}', ' {"answer": 42}', []),
    "mistral one call": (
        MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', None, [WEATHER]),
    "mistral two calls": (
        MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                 '{"name": "get_time", "arguments": {}}]',
        None, [WEATHER, TIME]),
    "mistral content before": (
        MISTRAL, 'Sure: [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Sure: ", [TIME]),
    "mistral malformed": (
        MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {}]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}]', []),
    "mistral no array": (
        MISTRAL, '[TOOL_CALLS] get_time()', '[TOOL_CALLS] get_time()', []),
    "required one call": (
        REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]', None, [WEATHER]),
    "required two calls": (
        REQUIRED, '[ {"name": "get_weather", "parameters": {"city": "Paris", "days": 3}} ,{"name":"get_time",'
                  '"parameters":{}} ]',
        None, [WEATHER, ParsedCall("get_time", "{}")]),
    "required cut short": (
        REQUIRED, '[{"name": "get_weather", "parameters": {"ci', '[{"name": "get_weather", "parameters": {"ci', []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parse_a_whole_output(case):
    parser, text, content, calls = CASES[case]
    assert parser.parse(text) == (content, calls)


def _streamed(parser, pieces: list[str]) -> tuple[str | None, list[ParsedCall]]:
    stream = parser.stream()
    events = [e for piece in pieces[:-1] for e in stream.feed(piece)] + stream.finish(pieces[-1])
    content, calls = collect(events)
    return (content or None) if calls else content, calls


@pytest.mark.parametrize("case", [c for c in CASES if "cut short" not in c and "malformed" not in c] +
                         ["hermes no name", "mistral no array"])
def test_every_split_into_three_pieces_gives_the_whole_outputs_content_and_calls(case):
    parser, text, content, calls = CASES[case]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed(parser, [text[:i], text[i:j], text[j:]]) == (content, calls), (i, j)


@pytest.mark.parametrize("case", ["hermes one call", "hermes content before", "llama3 two calls", "mistral two calls",
                                  "required two calls", "hermes no name"])
def test_streamed_a_character_at_a_time(case):
    parser, text, content, calls = CASES[case]
    assert _streamed(parser, list(text) + [""]) == (content, calls)


def test_a_stream_sends_the_name_first_then_argument_pieces_and_never_a_calls_text_as_content():
    stream = HERMES.stream()
    assert stream.feed("Hi <tool") == [Content("Hi ")]  # "<tool" may open a call: held back
    assert stream.feed('_call>{"name": "get_') == []  # the name is not complete yet
    assert stream.feed('weather", "arguments": {"ci') == [CallStart(0, "get_weather"), CallArguments(0, '{"ci')]
    assert stream.feed('ty": "Paris"}}</tool_call>\n') == [CallArguments(0, 'ty": "Paris"}')]
    assert stream.feed("<tool_call>") == []
    assert stream.finish('{"name": "get_time"}</tool_call>') == [CallStart(1, "get_time"), CallArguments(1, "{}")]


def test_a_call_that_breaks_after_its_start_was_streamed_keeps_what_was_sent():
    # A client has the name already: the stream cannot take it back, so what follows is content
    # (read whole, the same text is all content: test_parse_a_whole_output).
    stream = HERMES.stream()
    assert stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": ') == [
        CallStart(0, "get_weather"), CallArguments(0, '{"city": ')]
    assert stream.finish("Paris}}</tool_call><tool_call>") == [Content("Paris}}</tool_call><tool_call>")]


def test_a_named_call_streams_the_whole_output_as_its_arguments():
    stream = NamedCallStream("get_weather")
    assert stream.feed('{"ci') == [CallStart(0, "get_weather"), CallArguments(0, '{"ci')]
    assert stream.feed("") == []
    assert stream.finish('ty": "Paris"}') == [CallArguments(0, 'ty": "Paris"}')]


def test_json_details_a_call_may_hold():
    text = ('<tool_call>{"arguments": {"s": "a\\"}\\u00e9\\n", "n": [-0.5e+3, 0, true, false, null, {}, []]}, '
            '"name": "f\\u0031", "id": 7}</tool_call>')
    assert HERMES.parse(text) == (None, [ParsedCall("f1", '{"s": "a\\"}\\u00e9\\n", "n": [-0.5e+3, 0, true, false, '
                                                          'null, {}, []]}')])
    for bad in ('{"name": "f", "arguments": {"n": 01}}', '{"name": "f", "arguments": {"s": "\\x"}}',
                '{"name": "f", "arguments": [1]}', '{"name": 3}', '{"name": "f", "name": "g"}',
                '{"name": "f", "arguments": {}, "parameters": {}}', '{"name": "f", "arguments": {"a": 1,}}'):
        assert HERMES.parse(f"<tool_call>{bad}</tool_call>") == (f"<tool_call>{bad}</tool_call>", []), bad


def test_ids():
    assert re.fullmatch(r"call_[0-9a-f]{24}", HERMES.new_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral_call_id()) and MISTRAL.new_call_id is mistral_call_id
    assert HERMES.new_call_id() != HERMES.new_call_id()


def test_registry_and_markers():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert tool_parser("hermes") is HERMES
    with pytest.raises(ValueError, match=r"^tool_call_parser: must be one of hermes, llama3_json, mistral, "
                                         r"got 'qwen'$"):
        tool_parser("qwen")
    assert HERMES.markers == ("</tool_call>", "<tool_call>")
    assert LLAMA3_JSON.markers == ("<|python_tag|>",)
    assert MISTRAL.markers == ("[TOOL_CALLS]",)


@pytest.mark.parametrize("case", [c for c in CASES if "cut short" not in c and "malformed" not in c] +
                         ["hermes no name", "mistral no array"])
def test_a_stream_that_drops_what_it_sent_after_every_piece_says_the_same(case, monkeypatch):
    """The stream drops the text it has sent once that is long (appending to one growing string
    is quadratic in a long answer's length); dropped after every piece, long content before the
    calls and every split into three pieces give the whole output's content and calls."""
    from tandem.router.tool_parsers import call_stream

    monkeypatch.setattr(call_stream, "_TRIM_CHARS", 0)
    parser, text, content, calls = CASES[case]
    prose = "Some prose that comes first. " * 40 if parser is HERMES or "content before" in case else ""
    whole = prose + text
    expected = ((prose + (content or "")) or None, calls) if calls else (prose + content, calls)
    for i in range(0, len(whole) + 1, 7):
        for j in range(i, len(whole) + 1, 5):
            assert _streamed(parser, [whole[:i], whole[i:j], whole[j:]]) == expected, (i, j)
    assert _streamed(parser, list(whole) + [""]) == expected
