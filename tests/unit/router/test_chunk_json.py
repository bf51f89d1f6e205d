"""ChunkJson writes the same bytes as pydantic's `model_dump_json` for every plain chunk: texts
of every kind of character, every finish, stop strings and stop token ids, both APIs."""

from __future__ import annotations

import json
import random

import pytest

from tandem.router.chunk_json import ChunkJson
from tandem.router.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from tandem.router.streams import sse

# Every control character, JSON's two escapes, non-ASCII of one to four UTF-8 bytes, DEL, the
# line and paragraph separators (JSON allows them raw; pydantic keeps them raw).
ALPHABET = [chr(c) for c in range(0x20)] + ['"', "\\", "/", "a", " ", "\x7f", "é", "€", "中", "😀",
                                            "\u2028", "\u2029", "\ufffd", "\ud7ff", "\ue000"]
REASONS = [(None, None), ("stop", None), ("stop", "</s>"), ("stop", 2), ("length", None), ("abort", None),
           ("stop", 'a"b\\\n')]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["", "plain"] + ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 24))) for _ in range(count)]


@pytest.mark.parametrize("request_id,model", [("cmpl-0", "tiny"), ('id "quoted" \\', "org/模型-é")])
def test_completion_chunks_match_pydantic_byte_for_byte(request_id: str, model: str) -> None:
    plain = ChunkJson("text_completion", request_id, 1_764_000_000, model)
    for i, text in enumerate(_texts(1, 200)):
        finish, stop = REASONS[i % len(REASONS)]
        expected = sse(CompletionResponse(id=request_id, created=1_764_000_000, model=model, choices=[
            CompletionChoice(index=i % 3, text=text, finish_reason=finish, stop_reason=stop)]))
        got = plain.completion(i % 3, text, finish, stop)
        assert got.encode() == expected.encode()
        assert json.loads(got[len("data: "):])["choices"][0]["text"] == text


@pytest.mark.parametrize("request_id,model", [("chatcmpl-0", "tiny"), ('id "quoted" \\', "org/模型-é")])
def test_chat_chunks_match_pydantic_byte_for_byte(request_id: str, model: str) -> None:
    plain = ChunkJson("chat.completion.chunk", request_id, 7, model)
    for i, text in enumerate([None] + _texts(2, 200)):
        finish, stop = REASONS[i % len(REASONS)]
        expected = sse(ChatCompletionChunk(id=request_id, created=7, model=model, choices=[
            ChatChunkChoice(index=i % 2, delta=DeltaMessage(content=text), finish_reason=finish, stop_reason=stop)]))
        assert plain.chat(i % 2, text, finish, stop).encode() == expected.encode()
