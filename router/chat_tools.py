"""ToolCalling: what a chat request's `tools` and `tool_choice` make of its prompt, its decoding
and its reply, as vLLM does them.

    tool_choice   the prompt            decoding                      the reply
    none          tools in the template  free                         text (never read for calls)
    auto          tools in the template  free                         the family's call syntax read
                                                                      out (tool_parsers/): content
                                                                      and tool_calls
    required      tools in the template  an array of calls, each      tool_calls
                                         one tool's name and schema
    a function    tools in the template  that function's arguments    one call to it

"auto" (also what tools without a tool_choice mean) needs the server's `tool_call_parser` and
`enable_auto_tool_choice` (vLLM's --tool-call-parser and --enable-auto-tool-choice); without
them it is a 400 that says how to turn them on, never text that silently ignores the tools.
Forced calls need no parser: the engine holds the output to tool_schema.py's schema, so their
arguments always parse, and a reply with calls finishes with "tool_calls" (unless cut short by
max_tokens: "length"). With `parallel_tool_calls: false` a reply has at most one call.

A marker the tokenizer counts as a special token (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`) would be dropped by decoding, so an "auto" request keeps special tokens in its
text, as vLLM does, and the end-of-sequence token's text that then ends it is cut off again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.router.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tandem.router.tool_parsers.call_stream import (
    CallArguments,
    CallStart,
    CallStream,
    Content,
    Event,
    ToolParser,
    collect,
    openai_call_id,
)
from tandem.router.tool_parsers.forced import REQUIRED, NamedCallStream
from tandem.router.tool_parsers.registry import TOOL_PARSERS, tool_parser
from tandem.router.tool_schema import forced_call_spec, parameters_schema, required_calls_schema
from tandem.workers.structured.spec import StructuredSpec

AUTO_NEEDS = ("tool_choice: \"auto\" (what tools without a tool_choice mean) needs a server started with "
              "--enable-auto-tool-choice and --tool-call-parser ({parsers}); send tool_choice \"required\", "
              "a named function or \"none\", or start the server with them")


def tool_call_options(serving: dict[str, Any]) -> dict[str, Any]:
    """The ingress's tool options from the serving options, checked when the application is
    built: ValueError for an unknown parser, or auto tool choice without one (as vLLM refuses)."""
    name, auto = serving.get("tool_call_parser"), serving.get("enable_auto_tool_choice", False)
    if name is not None:
        tool_parser(name)
    if not isinstance(auto, bool):
        raise ValueError(f"enable_auto_tool_choice: must be true or false, got {auto!r}")
    if auto and name is None:
        raise ValueError(f"enable_auto_tool_choice: needs tool_call_parser ({', '.join(sorted(TOOL_PARSERS))})")
    return {"tool_call_parser": name, "enable_auto_tool_choice": auto}


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates take it: an assistant's call arguments as objects, not
    text (what HF's tool-use templates read, and what vLLM passes them)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


class ToolCalling:
    """The server's tool options, over its tokenizer (one per ingress replica)."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False) -> None:
        self.tokenizer = tokenizer
        self.parser = tool_parser(tool_call_parser) if tool_call_parser is not None else None
        self.auto = enable_auto_tool_choice and self.parser is not None
        # Whether decoding would drop a marker of the parser (then special tokens stay in the text).
        self.keeps_special_tokens = self.parser is not None and any(
            _dropped_by_decoding(tokenizer, marker) for marker in self.parser.markers)
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    def plan(self, req: ChatCompletionRequest) -> ToolPlan:
        """What `req` does with its tools; ValueError naming the field when it cannot be done."""
        mode = req.tool_mode
        if mode is None:
            return ToolPlan(self, None, None, None, None, True)
        tools = req.tools or []
        rendered = [_template_tool(tool.function) for tool in tools]
        if mode == "auto" and not self.auto:
            raise ValueError(AUTO_NEEDS.format(parsers=", ".join(sorted(TOOL_PARSERS))))
        structured = None
        if mode == "named":
            name = req.tool_choice.function.name
            function = next(tool.function for tool in tools if tool.function.name == name)
            structured = forced_call_spec(parameters_schema(function.parameters))
        elif mode == "required":
            structured = forced_call_spec(required_calls_schema(
                [(tool.function.name, tool.function.parameters) for tool in tools], req.parallel_calls))
        if structured is not None and req.structured_source is not None:
            raise ValueError(f"tool_choice: a forced tool call ({mode}) cannot be combined with "
                             f"{req.structured_source.field}: it sets the output's structure itself")
        parser = self.parser if mode == "auto" else REQUIRED if mode == "required" else None
        named = req.tool_choice.function.name if mode == "named" else None
        return ToolPlan(self, mode, rendered, structured, parser, req.parallel_calls, named)

    def stop_token_text(self, token_id: int) -> str:
        """The text a special token adds when special tokens are kept ("" for any other)."""
        if token_id not in self._special_ids:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class ToolPlan:
    calling: ToolCalling
    mode: str | None  # None (no tools), "none", "auto", "required" or "named"
    template_tools: list[dict[str, Any]] | None  # the tools as the chat template takes them
    structured: StructuredSpec | None  # a forced call's constraint
    parser: ToolParser | None  # reads calls out of the output ("auto", "required")
    parallel: bool
    named: str | None = None  # the function a named tool_choice calls

    @property
    def reads_calls(self) -> bool:
        return self.parser is not None or self.named is not None

    @property
    def forced(self) -> bool:
        """The engine holds the output to calls ("required" or a named function)."""
        return self.structured is not None

    @property
    def keeps_special_tokens(self) -> bool:
        return self.mode == "auto" and self.calling.keeps_special_tokens

    def adjust(self, sampling: dict[str, Any]) -> None:
        """`sampling` (SamplingParams' keyword arguments) made to serve the tools."""
        if self.structured is not None:
            sampling["structured"] = self.structured
        if self.keeps_special_tokens:
            sampling["skip_special_tokens"] = False

    def choice(self) -> ChoiceCalls:
        """One choice's reader (each of n choices has its own)."""
        stream = NamedCallStream(self.named) if self.named is not None else self.parser.stream()
        return ChoiceCalls(self, stream)

    def output_text(self, text: str, token_ids: list[int], finish_reason: str | None,
                    stop_reason: int | str | None) -> str:
        """A choice's (last) text less the end-of-sequence token's, where special tokens are kept."""
        if not (self.keeps_special_tokens and finish_reason == "stop" and token_ids
                and not isinstance(stop_reason, str)):
            return text
        piece = self.calling.stop_token_text(token_ids[-1])
        return text[:-len(piece)] if piece and text.endswith(piece) else text

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason

    def reply(self, text: str, token_ids: list[int], finish_reason: str | None,
              stop_reason: int | str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """A whole choice read for calls: its content, calls and finish reason (both APIs' replies)."""
        if not self.reads_calls:
            return text, [], finish_reason
        content, calls = self.choice().parse(self.output_text(text, token_ids, finish_reason, stop_reason))
        return content, calls, self.finish_reason(finish_reason, bool(calls))


class ChoiceCalls:
    """One choice's output read for calls, whole (`parse`) or as it streams (`deltas`)."""

    def __init__(self, plan: ToolPlan, stream: CallStream | NamedCallStream) -> None:
        self.plan = plan
        self._stream = stream
        self.num_calls = 0  # calls sent so far (within the parallel_tool_calls bound)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output's content (None when it is only calls) and calls."""
        content, calls = collect(self._stream.finish(text))
        calls = calls if self.plan.parallel else calls[:1]
        self.num_calls = len(calls)
        return ((content or None) if calls else content,
                [ToolCall(id=self._new_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in calls])

    def deltas(self, text: str, last: bool) -> list[DeltaMessage]:
        """The chunks' deltas for the output's next `text` (`last`: the output ends with it)."""
        events = self._stream.finish(text) if last else self._stream.feed(text)
        return self._to_deltas(events)

    def step(self, text: str, token_ids: list[int], finish_reason: str | None,
             stop_reason: int | str | None) -> tuple[list[DeltaMessage], str | None]:
        """One delta of the choice's output: the deltas it lets out and the choice's finish
        reason so far (both APIs' streams)."""
        text = self.plan.output_text(text, token_ids, finish_reason, stop_reason)
        deltas = self.deltas(text, last=finish_reason is not None)
        return deltas, self.plan.finish_reason(finish_reason, self.num_calls > 0)

    def _to_deltas(self, events: list[Event]) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for event in events:
            if isinstance(event, Content):
                out.append(DeltaMessage(content=event.text))
            elif not self.plan.parallel and event.index > 0:
                continue  # parallel_tool_calls false: the first call only
            elif isinstance(event, CallStart):
                self.num_calls += 1
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=event.index, id=self._new_id(), type="function",
                    function=DeltaFunctionCall(name=event.name, arguments=""))]))
            elif isinstance(event, CallArguments):
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=event.index, function=DeltaFunctionCall(arguments=event.text))]))
        return out

    def _new_id(self) -> str:
        return self.plan.parser.new_call_id() if self.plan.mode == "auto" else openai_call_id()


def _template_tool(function: Any) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        tool["description"] = function.description
    tool["parameters"] = parameters_schema(function.parameters)  # templates read it, given or not
    return {"type": "function", "function": tool}


def _dropped_by_decoding(tokenizer: Any, marker: str) -> bool:
    """Whether decoding with special tokens skipped loses `marker` (a special token of this vocabulary)."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True) != marker
