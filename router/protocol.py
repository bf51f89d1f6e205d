"""OpenAI-compatible request, response and error bodies (pydantic: the HTTP boundary only).

Requests are parsed strictly (a string where a number belongs is a 400, not a silent
conversion). OpenAI's (and vLLM's) fields that tandem does not do are refused by name
(request_fields.py); fields no API defines are ignored, as vLLM does, with a log line.
Ranges that OpenAI documents are checked here; everything else is checked by
`SamplingParams` behind the ingress. Structured outputs and logit_bias are
output_constraints.py's.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from tandem.router.output_constraints import OutputConstraints
from tandem.router.tool_request import MessageToolCall, ToolRequest
from tandem.workers.core.request import REPETITION_PENALTY_RANGE

MAX_N = 128
MAX_LOGPROBS = 20
# Counts and sizes beyond which a request is refused outright: each bounds the work or
# memory one request can ask for before anything checks it against the model.
MAX_PROMPTS = 128  # prompts in one completions request (one group request each)
MAX_MESSAGES = 1024  # chat messages
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 1024  # characters in one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_INT32 = 2**31 - 1  # token counts and ids (the gRPC API's width too)
MAX_SEED = 2**63 - 1  # torch generators take a signed 64-bit seed

_UNION_HINTS = {
    "prompt": "must be a string, an array of strings, an array of token ids or an array of token-id arrays",
    "stop": "must be a string or an array of strings",
    "messages": "each message needs a 'role' and a string (or text-part array) 'content'",
    "tool_choice": "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}


class _Strict(BaseModel):
    # NaN and infinities are refused: no sampling field means anything with them.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


# ---- requests ------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False
    # tandem pads no streamed chunk: false (or nothing) is what it does; true is refused.
    include_obfuscation: Literal[False] | None = None


class _SamplingRequest(_Strict, OutputConstraints):
    """Fields both APIs share (OpenAI's plus the vLLM extensions tandem supports)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # tandem's extension: seconds after arrival at which the request is aborted (its KV
    # freed) and answered 408 (an SSE error event once streaming has begun).
    timeout: float | None = Field(None, gt=0.0)

    def sampling_kwargs(self) -> dict[str, Any]:
        """The `SamplingParams` keyword arguments this request sets (unset ones keep defaults)."""
        kwargs: dict[str, Any] = {"n": self.n, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                                  "skip_special_tokens": self.skip_special_tokens,
                                  "include_stop_str_in_output": self.include_stop_str_in_output,
                                  **self.constraint_kwargs()}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def deadline(self) -> float | None:
        """When (time.monotonic()) the request's `timeout` runs out, counted from now; None: never."""
        return None if self.timeout is None else time.monotonic() + self.timeout

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # tandem returns every sample it draws: best_of may only repeat n.
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported (tandem does not rank extra samples); "
                             f"got best_of={self.best_of}, n={self.n}")
        return self

    @property
    def num_prompts(self) -> int:
        """Group requests this request becomes (one per prompt)."""
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant's message that only calls tools
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (tool_request.py checks them)
    tool_call_id: str | None = None  # a tool's message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest, ToolRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# ---- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


def _without(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`data` less those of `names` that are None: a client's stream accumulator takes a null
    `type` or `name` in a later chunk for a new value (the openai client's does)."""
    return {key: value for key, value in data.items() if value is not None or key not in names}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out when there are none

    @model_serializer(mode="wrap")
    def _no_null_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without(handler(self), ("tool_calls",))


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first chunk
    arguments: str | None = None  # a piece of the JSON text

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without(handler(self), ("name", "arguments"))


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first has its id, type and name (arguments ""), the
    rest pieces of its arguments; `index` says which call of the choice."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without(handler(self), ("id", "type", "function"))


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None  # left out when there are none

    @model_serializer(mode="wrap")
    def _no_null_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without(handler(self), ("tool_calls",))


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """GET /health: whether the service serves, and its replica groups by Serve state."""

    status: Literal["ok", "degraded", "unavailable"]
    groups: dict[str, int]  # RUNNING, RECOVERING, STARTING, ... -> how many groups


# ---- errors --------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI-style body."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
             415: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        # The message may quote the request: a lone surrogate there must not break the response.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = ErrorResponse(error=ErrorInfo(
            message=message, type=type or self.TYPES.get(status, "server_error"),
            param=None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8"), code=code))

    @classmethod
    def bad_request(cls, exc: ValueError | str) -> OpenAIError:
        """From a boundary `ValueError` whose message starts with the field name ("top_p: ...")."""
        message = str(exc)
        head, sep, _ = message.partition(":")
        param = head if sep and head.isidentifier() else None
        return cls(400, message, param=param, code="invalid_value" if param else None)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> OpenAIError:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "value_error" and not first["loc"]:  # a model validator's "field: ..." message
            return cls.bad_request(str(first["ctx"]["error"]))
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == param]
        # A list beyond its bounds matches no branch of a union: say so, not "must be one of".
        bounded = next((e for e in same_field if e["type"] in ("too_long", "too_short")), None)
        if bounded is not None:
            first = bounded
            message = f"{param}: {bounded['msg']}"
        elif param in _UNION_HINTS and len(same_field) > 1:
            message = f"{param}: {_UNION_HINTS[param]}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first['msg']}"
        code = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
        if first["type"].startswith(("greater", "less", "too_short", "too_long")):
            code = "invalid_value"
        return cls(400, message, param=param, code=code)
