"""Running one OpenAI request as several group requests, and the pieces both APIs share.

A completion with a list of prompts is one group request per prompt; `open_streams`
starts them all and waits for each one's first delta, so a request a group refuses
becomes an HTTP error before any byte of the response is sent. `merge` then yields
their deltas as they come. Leaving early (a client that disconnects) cancels every
group request, which aborts it and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.router.protocol import PromptTokensDetails, Usage
from tandem.workers.core.request import CompletionOutput, PositionLogprobs
from tandem.workers.serving.messages import GroupDelta

DONE = "data: [DONE]\n\n"
Deltas = AsyncIterator[GroupDelta]  # one group request's deltas (EngineClient.stream)


def sse(payload: Any) -> str:
    """One server-sent event with a pydantic model or a dict as its JSON data."""
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def _with_first(first: GroupDelta, rest: Deltas) -> Deltas:
    yield first
    async for delta in rest:
        yield delta


@dataclass
class Reply:
    """A whole response, or the SSE chunks of one; and which groups serve it (a header)."""

    body: Any  # a pydantic response model, or an async iterator of SSE strings
    group_ids: list[str]


async def open_streams(streams: Sequence[Deltas]) -> tuple[list[Deltas], list[str]]:
    """Await every stream's first delta; on any error close them all and raise the first.

    Returns the streams (from their first delta on) and the ids of the groups serving them."""
    results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise error
    group_ids = [first.group_id for first in results]
    return [_with_first(first, s) for first, s in zip(results, streams)], group_ids


async def merge(streams: Sequence[Deltas]) -> AsyncIterator[tuple[int, GroupDelta]]:
    """(stream index, delta) in arrival order; the first error ends the lot."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, GroupDelta | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: Deltas) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceState:
    """Everything one choice has produced so far (non-streaming responses and usage)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, output: CompletionOutput) -> None:
        self.text.append(output.text)
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs or ())
        self.finish_reason = output.finish_reason
        self.stop_reason = output.stop_reason


@dataclass
class UsageCounter:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _seen: set[int] = field(default_factory=set)

    def add(self, stream_index: int, delta: GroupDelta) -> None:
        if stream_index not in self._seen:  # prompts count once per prompt, not per choice
            self._seen.add(stream_index)
            self.prompt_tokens += delta.num_prompt_tokens
        if delta.finished:
            self.cached_tokens += delta.num_cached_tokens
        self.completion_tokens += delta.num_output_tokens

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

