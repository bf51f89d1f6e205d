"""POST /v1/chat/completions: messages through the model's chat template, one group request.

With tools, chat_tools.py decides what the template shows, what the engine is held to and how
each choice's text is read for calls; a choice's calls come back as OpenAI writes them: whole in
`message.tool_calls`, or streamed as a first chunk with the call's index, id, type, name and
empty arguments, then chunks with pieces of its arguments.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from tandem.router.chat_tools import ChoiceCalls, ToolCalling, ToolPlan, template_message
from tandem.router.chunk_json import ChunkJson
from tandem.router.engine_client import EngineClient, sampling_params
from tandem.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from tandem.router.sse_response import LastChunk
from tandem.router.streams import DONE, ChoiceState, Deltas, Reply, UsageCounter, merge, open_streams, sse
from tandem.workers.core.request import PositionLogprobs


class ChatServing:
    def __init__(self, client: EngineClient, *, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False) -> None:
        self.client = client
        self.tools = ToolCalling(client.tokenizer, tool_call_parser, enable_auto_tool_choice)

    async def prompt_token_ids(self, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        messages = [template_message(m) for m in req.messages]
        # The template writes any special tokens itself (as LLM.chat does).
        return await self.client.text.render_chat(messages, "messages", tools=tools)

    def sampling(self, req: ChatCompletionRequest) -> dict:
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        sampling = req.sampling_kwargs()
        # No limit given: up to the context length (the engine's max_tokens=None).
        sampling["max_tokens"] = req.max_completion_tokens or req.max_tokens
        if req.logprobs:
            sampling["logprobs"] = req.top_logprobs or 0
        return sampling

    async def create(self, req: ChatCompletionRequest) -> Reply:
        deadline = req.deadline()
        plan = self.tools.plan(req)
        token_ids = await self.prompt_token_ids(req, plan.template_tools)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream, group_ids = await self.start(plan, token_ids, self.sampling(req), request_id, deadline,
                                             final_only=not req.stream)
        if req.stream:
            return Reply(self._stream(req, plan, request_id, stream), group_ids)
        return Reply(await self._collect(req, plan, request_id, stream), group_ids)

    async def start(self, plan: ToolPlan, token_ids: list[int], sampling: dict, request_id: str,
                    deadline: float | None, *, final_only: bool) -> tuple[Deltas, list[str]]:
        """The group request of a rendered chat, its sampling made to serve the tools, sent (the
        gRPC Chat's path too): its deltas from the first on, and the groups serving it."""
        plan.adjust(sampling)
        if plan.structured is not None:  # compiled before any group sees it: a bad schema is a 400 now
            await self.client.grammar.check(plan.structured, "tools")
        params = sampling_params(sampling)
        # The prompt is the rendered messages: its errors name them.
        request = self.client.request(request_id, token_ids, params, final_only=final_only, field="messages")
        [stream], group_ids = await open_streams([self.client.stream(request, deadline)])
        return stream, group_ids

    async def _collect(self, req, plan: ToolPlan, request_id, stream) -> ChatCompletionResponse:
        choices: dict[int, ChoiceState] = {}
        usage = UsageCounter()
        async for _, delta in merge([stream]):
            usage.add(0, delta)
            for out in delta.outputs:
                choices.setdefault(out.index, ChoiceState(out.index)).add(out)
        result = []
        for c in (choices[i] for i in sorted(choices)):
            content, calls, finish_reason = plan.reply("".join(c.text), c.token_ids, c.finish_reason, c.stop_reason)
            message = AssistantMessage(content=content, tool_calls=calls or None)
            result.append(ChatChoice(index=c.index, message=message,
                                     logprobs=_logprobs(c.token_ids, c.logprobs, req) if req.logprobs else None,
                                     finish_reason=finish_reason, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=self.client.model_name,
                                      choices=result, usage=usage.usage())

    async def _stream(self, req, plan: ToolPlan, request_id, stream) -> AsyncIterator[str]:
        created, model = int(time.time()), self.client.model_name
        usage = UsageCounter()
        finished: set[int] = set()  # the group repeats a finished choice of n > 1 until all end
        readers: dict[int, ChoiceCalls] = {i: plan.choice() for i in range(req.n)} if plan.reads_calls else {}

        plain = ChunkJson("chat.completion.chunk", request_id, created, model)

        def chunk(choice: ChatChunkChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

        # A forced call's reply is calls only: content null from the first chunk, as OpenAI sends it.
        first = DeltaMessage(role="assistant", content=None if plan.forced else "")
        # What one delta says is one piece (one body message), the role chunks with the first;
        # the last delta's pieces go out with the usage and [DONE] (router/sse_response.py).
        parts = [chunk(ChatChunkChoice(index=i, delta=first)) for i in range(req.n)]
        async for _, delta in merge([stream]):
            usage.add(0, delta)
            for out in delta.outputs:
                if out.index in finished:
                    continue
                if out.finish_reason:
                    finished.add(out.index)
                logprobs = _logprobs(out.token_ids, out.logprobs or [], req) if req.logprobs else None
                reader = readers.get(out.index)
                if reader is None:
                    if logprobs is None:
                        if out.text or out.finish_reason:
                            parts.append(plain.chat(out.index, out.text or None, out.finish_reason,
                                                    out.stop_reason))
                    elif out.text or out.finish_reason or logprobs.content:
                        parts.append(chunk(ChatChunkChoice(
                            index=out.index, delta=DeltaMessage(content=out.text or None), logprobs=logprobs,
                            finish_reason=out.finish_reason, stop_reason=out.stop_reason)))
                    continue
                deltas, finish_reason = reader.step(out.text, out.token_ids, out.finish_reason, out.stop_reason)
                if not deltas and (out.finish_reason or (logprobs and logprobs.content)):
                    deltas = [DeltaMessage()]
                for k, message in enumerate(deltas):  # logprobs with the first, the finish with the last
                    last = k == len(deltas) - 1
                    parts.append(chunk(ChatChunkChoice(
                        index=out.index, delta=message, logprobs=logprobs if k == 0 else None,
                        finish_reason=finish_reason if last else None, stop_reason=out.stop_reason if last else None)))
            if not delta.finished and parts:
                yield "".join(parts)
                parts = []
        if req.include_usage:
            parts.append(sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                                 usage=usage.usage())))
        yield LastChunk("".join(parts) + DONE)


def _logprobs(token_ids: list[int], entries: list[PositionLogprobs], req: ChatCompletionRequest) -> ChatLogprobs:
    """The chat form: per token, its logprob and the `top_logprobs` most likely alternatives."""
    num_top = req.top_logprobs or 0
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda e: e.rank)[:num_top]
        content.append(TokenLogprob(token=chosen.decoded_token or "", logprob=chosen.logprob,
                                    bytes=_bytes(chosen.decoded_token),
                                    top_logprobs=[TopLogprob(token=e.decoded_token or "", logprob=e.logprob,
                                                             bytes=_bytes(e.decoded_token)) for e in ranked]))
    return ChatLogprobs(content=content)


def _bytes(token: str | None) -> list[int] | None:
    return None if token is None else list(token.encode("utf-8"))
