"""Reading a call the server forced (`tool_choice` "required" or a named function), whose shape
the engine enforced with tool_schema.py's schema.

"required": a JSON array of `{"name": ..., "parameters": {...}}`, read by the same machine as the
families. A named function: the whole output is its arguments (the name is the request's), so
it streams as it comes, with nothing to hold back.
"""

from __future__ import annotations

from tandem.router.tool_parsers.call_stream import CALL, WS, CallArguments, CallStart, CallSyntax, Event, ToolParser

REQUIRED = ToolParser("required", CallSyntax(
    openers={},
    leading=(WS, "[", WS, CALL),
    after_call={",": (WS, CALL), "]": "end"},
    states={"end": {}},
))


class NamedCallStream:
    """The output as the arguments of one call to `name`, in the pieces it comes in."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False
        self.num_calls = 1

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = [] if self._started else [CallStart(0, self._name)]
        self._started = True
        if text:
            events.append(CallArguments(0, text))
        return events

    def finish(self, text: str = "") -> list[Event]:
        return self.feed(text)
