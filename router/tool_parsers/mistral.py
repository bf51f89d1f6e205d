"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any text
(vLLM's `mistral` parser, for the JSON-array form of Mistral's v3 tokenizers).

Its ids are 9 letters and digits, as vLLM makes them: Mistral's chat templates refuse any other
`tool_call_id` when the conversation comes back with the tools' results."""

from __future__ import annotations

import secrets
import string

from tandem.router.tool_parsers.call_stream import CALL, WS, CallSyntax, ToolParser

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


MISTRAL = ToolParser("mistral", CallSyntax(
    openers={TOOL_CALLS: (WS, "[", WS, CALL)},
    after_call={",": (WS, CALL), "]": "between"},
    states={"between": {TOOL_CALLS: (WS, "[", WS, CALL)}},
), new_call_id=mistral_call_id)
