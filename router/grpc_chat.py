"""The Chat RPCs' messages (tandem.proto's ChatRequest, ChatChoice, ChatChoiceDelta) mapped onto
the chat route's own request and reply pieces.

A ChatRequest becomes the ChatCompletionRequest that POST /v1/chat/completions validates
(protocol.py, tool_request.py), so both APIs check messages and tools by the same rules and run
the same tool plan (chat_tools.py); its errors name the proto's fields (`tools.0.name`, where the
JSON body says `tools.0.function.name`). A reply is what ChatServing reads out of a choice (a
whole one's content and calls from `ToolPlan.reply`, a streamed one's deltas from
`ChoiceCalls.step`), written as protos.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tandem.router import tandem_pb2 as pb
from tandem.router.limits import parse_json_object
from tandem.router.output_constraints import SpecSource
from tandem.router.protocol import ChatCompletionRequest, DeltaMessage, OpenAIError, ToolCall

TOOL_MODES = ("none", "auto", "required")


def chat_request(proto: pb.ChatRequest, structured: SpecSource | None, max_json_depth: int) -> ChatCompletionRequest:
    """The chat route's request for a ChatRequest's messages and tools; ValueError naming the field.
    `structured` is the spec SamplingParams sets (and its field), which a forced call excludes."""
    body: dict[str, Any] = {"messages": [_message(m) for m in proto.messages]}
    if proto.tools:
        body["tools"] = [_tool(i, tool, max_json_depth) for i, tool in enumerate(proto.tools)]
    kind = proto.tool_choice.WhichOneof("choice") if proto.HasField("tool_choice") else None
    if kind == "mode":
        if proto.tool_choice.mode not in TOOL_MODES:
            raise ValueError(f"tool_choice.mode: must be \"none\", \"auto\" or \"required\", got "
                             f"{proto.tool_choice.mode!r}")
        body["tool_choice"] = proto.tool_choice.mode
    elif kind == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": proto.tool_choice.function}}
    if proto.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = proto.parallel_tool_calls
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise ValueError(_proto_path(str(OpenAIError.from_validation(exc)))) from None
    # Where the JSON body's constraint fields would have put it: the tool plan refuses a forced
    # call with it, naming the SamplingParams field.
    req._structured = structured
    return req


def tool_calls(calls: list[ToolCall]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments) for call in calls]


def add_deltas(choice: pb.ChatChoiceDelta, deltas: list[DeltaMessage]) -> None:
    """A streamed choice's pieces in one message: its content joined, its calls' pieces in order."""
    for delta in deltas:
        choice.content += delta.content or ""
        for call in delta.tool_calls or ():
            function = call.function
            choice.tool_calls.add(index=call.index, id=call.id or "", name=(function and function.name) or "",
                                  arguments=(function and function.arguments) or "")


def _message(proto: pb.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": proto.role}
    for name in ("content", "name", "tool_call_id"):
        if proto.HasField(name):
            message[name] = getattr(proto, name)
    if proto.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in proto.tool_calls]
    return message


def _tool(index: int, proto: pb.Tool, max_json_depth: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": proto.name}
    if proto.HasField("description"):
        function["description"] = proto.description
    if proto.parameters:
        try:  # read as an HTTP body is: no NaN, no nesting past the bound
            function["parameters"] = parse_json_object(proto.parameters.encode(), max_json_depth)
        except OpenAIError as exc:
            reason = str(exc).replace("invalid JSON body", "invalid JSON").replace("the request body", "the schema")
            raise ValueError(f"tools.{index}.parameters: {reason}") from None
    return {"type": "function", "function": function}


def _proto_path(message: str) -> str:
    """A validation message with the JSON body's path made the proto's (no `function` level)."""
    head, sep, rest = message.partition(": ")
    return head.replace(".function.", ".") + sep + rest
