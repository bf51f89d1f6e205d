"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
element per call, after any text (vLLM's `hermes` parser; Qwen2.5 and Qwen3 write the same)."""

from __future__ import annotations

from tandem.router.tool_parsers.call_stream import CALL, WS, CallSyntax, ToolParser

# The closing tag may be missing (the output ends, or the next call opens at once).
HERMES = ToolParser("hermes", CallSyntax(
    openers={"<tool_call>": (WS, CALL)},
    after_call={"</tool_call>": "after_call", "<tool_call>": (WS, CALL)},
))
