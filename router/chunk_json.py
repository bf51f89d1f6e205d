"""ChunkJson: a stream's plain SSE chunks (text or content, a finish; no logprobs, no tool
calls, no role, no usage) written as strings, byte for byte what pydantic's
`model_dump_json` writes for the same `CompletionResponse` / `ChatCompletionChunk`.

A streamed request sends one such chunk per message to its client, for every stream of the
ingress: building and dumping the pydantic models costs about ten times what writing the
string does (bench/RESULTS.md). The part every chunk of a stream shares (id, object, created,
model) is written once. Every other chunk (logprobs, tool calls, the role's first chunk, usage) keeps the
models. tests/unit/router/test_chunk_json.py holds the two to the same bytes.
"""

from __future__ import annotations

from json.encoder import encode_basestring  # the C encoder; non-ASCII kept, as pydantic keeps it


def _value(value: str | int | None) -> str:
    """A finish or stop reason (a stop string, a stop token id) as JSON."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return str(int(value))


class ChunkJson:
    """The plain chunks of one streamed response ("text_completion" or "chat.completion.chunk")."""

    __slots__ = ("_head",)

    def __init__(self, obj: str, request_id: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{encode_basestring(request_id)},"object":{encode_basestring(obj)},'
                      f'"created":{int(created)},"model":{encode_basestring(model)},"choices":[{{"index":')

    def completion(self, index: int, text: str, finish_reason: str | None = None,
                   stop_reason: str | int | None = None) -> str:
        """A completions chunk: `CompletionChoice(index, text, None, finish_reason, stop_reason)`."""
        return (f'{self._head}{int(index)},"text":{encode_basestring(text)},"logprobs":null,'
                f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)}}}],"usage":null}}\n\n')

    def chat(self, index: int, content: str | None, finish_reason: str | None = None,
             stop_reason: str | int | None = None) -> str:
        """A chat chunk: `ChatChunkChoice(index, DeltaMessage(content=content), None, finish_reason,
        stop_reason)`."""
        return (f'{self._head}{int(index)},"delta":{{"role":null,"content":{_value(content)}}},"logprobs":null,'
                f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)}}}],"usage":null}}\n\n')
