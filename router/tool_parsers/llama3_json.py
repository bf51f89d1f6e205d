"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole output, or after
`<|python_tag|>`; several calls separated by ";" (vLLM's `llama3_json` parser).

Only an output that starts with "{" (after whitespace) or a `<|python_tag|>` is read as calls:
a brace in the middle of prose is prose."""

from __future__ import annotations

from tandem.router.tool_parsers.call_stream import CALL, WS, CallSyntax, ToolParser

PYTHON_TAG = "<|python_tag|>"

LLAMA3_JSON = ToolParser("llama3_json", CallSyntax(
    openers={PYTHON_TAG: (WS, CALL)},
    leading=(WS, CALL),
    after_call={";": (WS, CALL), CALL: (), PYTHON_TAG: (WS, CALL)},
))
