"""POST /v1/completions: prompts in, choices (whole or streamed) out.

Choice `index` is `prompt_index * n + i`, as OpenAI and vLLM number them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.router.chunk_json import ChunkJson
from tandem.router.engine_client import EngineClient, sampling_params
from tandem.router.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tandem.router.sse_response import LastChunk
from tandem.router.streams import DONE, ChoiceState, Reply, UsageCounter, merge, open_streams, sse
from tandem.workers.core.request import PositionLogprobs


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str


class CompletionServing:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def prompts(self, req: CompletionRequest) -> list[_Prompt]:
        text = self.client.text
        raw = req.prompt
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(p, int) for p in raw):
            raw = [raw]
        for p in raw:  # every text's length first: one too long is refused before any is tokenized
            if isinstance(p, str):
                text.check_length(len(p), "prompt")
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append(_Prompt(await text.tokenize(p, "prompt"), p))
            else:
                prompts.append(_Prompt(list(p), await text.decode(list(p)) if req.echo else ""))
        return prompts

    def sampling(self, req: CompletionRequest) -> dict:
        sampling = req.sampling_kwargs()
        sampling["max_tokens"] = req.max_tokens
        if req.logprobs is not None:
            sampling["logprobs"] = req.logprobs
            if req.echo:  # the echoed prompt comes with its tokens' logprobs too
                sampling["prompt_logprobs"] = req.logprobs
        return sampling

    async def create(self, req: CompletionRequest) -> Reply:
        """Validate (ValueError), start every prompt's group request, then answer or stream."""
        deadline = req.deadline()
        prompts = await self.prompts(req)
        params = sampling_params(self.sampling(req))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # Every prompt is checked before any group request starts.
        requests = [self.client.request(f"{request_id}-{i}", p.token_ids, params, final_only=not req.stream)
                    for i, p in enumerate(prompts)]
        streams, group_ids = await open_streams([self.client.stream(r, deadline) for r in requests])
        if req.stream:
            return Reply(self._stream(req, request_id, prompts, streams), group_ids)
        return Reply(await self._collect(req, request_id, prompts, streams), group_ids)

    def _prompt_logprobs(self, prompt: _Prompt, entries: list[PositionLogprobs | None] | None) -> CompletionLogprobs:
        """The echoed prompt's part of a choice's logprobs (its first token has none)."""
        out = CompletionLogprobs()
        if entries is None:  # nothing came back for it: leave the prompt out, never guess
            return out
        _logprobs(prompt.token_ids, entries, out)
        if out.tokens:  # the first token's text: decoded here, no logprob scores it
            out.tokens[0] = self.client.tokenizer.decode(prompt.token_ids[:1])
            for i in range(1, len(out.text_offset)):
                out.text_offset[i] += len(out.tokens[0])
        return out

    async def _collect(self, req, request_id, prompts, streams) -> CompletionResponse:
        choices = {}
        usage = UsageCounter()
        prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs
        async for i, delta in merge(streams):
            usage.add(i, delta)
            if delta.prompt_logprobs is not None:
                prompt_logprobs[i] = delta.prompt_logprobs
            for out in delta.outputs:
                index = i * req.n + out.index
                choices.setdefault(index, ChoiceState(index)).add(out)
        result = []
        for index in sorted(choices):
            c = choices[index]
            prompt = prompts[index // req.n]
            text = "".join(c.text)
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobs()
                if req.echo:
                    logprobs = self._prompt_logprobs(prompt, prompt_logprobs.get(index // req.n))
                _logprobs(c.token_ids, c.logprobs, logprobs)
            result.append(CompletionChoice(index=index, text=(prompt.text if req.echo else "") + text,
                                           logprobs=logprobs, finish_reason=c.finish_reason,
                                           stop_reason=c.stop_reason))
        return CompletionResponse(id=request_id, created=int(time.time()), model=self.client.model_name,
                                  choices=result, usage=usage.usage())

    async def _stream(self, req, request_id, prompts, streams) -> AsyncIterator[str]:
        created, model = int(time.time()), self.client.model_name
        usage = UsageCounter()
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        finished: set[int] = set()  # the group repeats a finished choice of n > 1 until all end

        plain = ChunkJson("text_completion", request_id, created, model)

        def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            if logprobs is None:
                return plain.completion(index, text, finish_reason, stop_reason)
            return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                stop_reason=stop_reason)]))

        # What one delta says is one piece (one body message); the last delta's pieces go out
        # with the usage and [DONE], closing the response (router/sse_response.py).
        parts: list[str] = []
        running = len(streams)
        echo_with_logprobs = req.echo and req.logprobs is not None
        if req.echo and not echo_with_logprobs:
            for i, p in enumerate(prompts):
                for k in range(req.n):
                    parts.append(chunk(i * req.n + k, p.text))
        async for i, delta in merge(streams):
            usage.add(i, delta)
            if echo_with_logprobs and delta.prompt_logprobs is not None:
                # The prompt's logprobs arrive with its first token: echo it just before.
                for k in range(req.n):
                    lps = self._prompt_logprobs(prompts[i], delta.prompt_logprobs)
                    offsets[i * req.n + k] = len(prompts[i].text)
                    parts.append(chunk(i * req.n + k, prompts[i].text, lps))
            for out in delta.outputs:
                index = i * req.n + out.index
                if index in finished:
                    continue
                if out.finish_reason:
                    finished.add(index)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    _logprobs(out.token_ids, out.logprobs or [], logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                if out.text or out.finish_reason or (logprobs and logprobs.tokens):
                    parts.append(chunk(index, out.text, logprobs, out.finish_reason, out.stop_reason))
            running -= delta.finished
            if running and parts:
                yield "".join(parts)
                parts = []
        if req.include_usage:
            parts.append(sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                                usage=usage.usage())))
        yield LastChunk("".join(parts) + DONE)


def _logprobs(token_ids: list[int], entries: list[PositionLogprobs | None], out: CompletionLogprobs,
              offset: int | None = None) -> None:
    """Append to the legacy completions form: parallel lists of tokens, their logprobs, top
    alternatives and text offsets (continuing from the text already in `out`)."""
    if offset is None:
        offset = out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else 0
    for token_id, entry in zip(token_ids, entries):
        if entry is None:  # the first prompt token: nothing predicts it
            out.tokens.append("")
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            continue
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(chosen.logprob)
        ranked = sorted(entry.values(), key=lambda e: e.rank)
        out.top_logprobs.append({(e.decoded_token or ""): e.logprob for e in ranked})
        out.text_offset.append(offset)
        offset += len(token)
