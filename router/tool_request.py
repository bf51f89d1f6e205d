"""The tool-calling fields of a chat request, as OpenAI defines them, checked at the boundary.

    tools                [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice          "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls  false: at most one call
    functions, function_call
                         OpenAI's deprecated forms: refused by name (a client that sends them
                         reads `message.function_call` back, which tandem does not write)

Mixed into ChatCompletionRequest (protocol.py); the messages' own tool parts (an assistant's
`tool_calls`, a tool's `tool_call_id`) are ChatMessage's. Every rule below is a 400 that names
the field: a request that asks for a tool call and gets text would break its client far from
the cause.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.workers.structured.spec import MAX_SPEC_CHARS

MAX_TOOLS = 128  # OpenAI's bound
# All tools' parameters together, as JSON: a forced call's schema holds every one of them and
# the grammar engine takes at most MAX_SPEC_CHARS (tool_schema.py says so past it).
MAX_TOOLS_SCHEMA_CHARS = MAX_SPEC_CHARS
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule; it also keeps names plain in a schema


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)  # protocol.py's _Strict


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None  # forced calls are always held to the schema; others never are


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # a JSON object's text


class MessageToolCall(_Strict):
    """A call an earlier assistant message made (the conversation sent back)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolRequest(_Strict):
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # refused (see above)
    function_call: str | dict[str, Any] | None = None  # refused (see above)

    @model_validator(mode="after")
    def _check_tools(self) -> ToolRequest:
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: deprecated by OpenAI and not supported; send tools and tool_choice")
        tools = self.tools or []
        names = [tool.function.name for tool in tools]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise ValueError(f"tools: the function {twice!r} is given twice")
        size = 0
        for tool in tools:
            parameters = tool.function.parameters
            if parameters is not None and parameters.get("type", "object") != "object":
                raise ValueError(f"tools: the parameters of {tool.function.name!r} must be a JSON schema of "
                                 f"type 'object', got type {parameters.get('type')!r}")
            size += len(json.dumps(parameters)) if parameters else 0
        if size > MAX_TOOLS_SCHEMA_CHARS:
            raise ValueError(f"tools: the functions' parameters are {size} characters of JSON; at most "
                             f"{MAX_TOOLS_SCHEMA_CHARS} are accepted")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise ValueError(f"tool_choice: {_choice_text(choice)} needs tools (none were given)")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: the function {choice.function.name!r} is not among the tools "
                             f"({', '.join(names)})")
        self._check_messages()
        return self

    def _check_messages(self) -> None:
        for i, message in enumerate(getattr(self, "messages", None) or ()):
            if message.tool_calls and message.role != "assistant":
                raise ValueError(f"messages: message {i} ({message.role}) has tool_calls; only an assistant's "
                                 f"message carries them")
            if message.role == "tool" and not message.tool_call_id:
                raise ValueError(f"messages: message {i} (tool) needs the 'tool_call_id' of the call it answers")
            for j, call in enumerate(message.tool_calls or ()):
                try:
                    arguments = json.loads(call.function.arguments)
                except (ValueError, RecursionError):  # nesting deeper than json can read: not a 500
                    arguments = None
                if not isinstance(arguments, dict):
                    raise ValueError(f"messages: message {i}'s tool call {j} ({call.function.name!r}) has "
                                     f"arguments that are not the text of a JSON object")

    @property
    def tool_mode(self) -> str | None:
        """None (no tools), "none", "auto", "required" or "named": what the reply does with them.
        Tools without a tool_choice mean "auto", as in OpenAI's API."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False


def _choice_text(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"the function {choice.function.name!r}"
