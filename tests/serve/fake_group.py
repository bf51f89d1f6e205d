"""An ingress over a fake replica group that answers any valid request: no Ray, so the
hostile-input battery and the fuzzers run thousands of requests in seconds.

`EchoGroup` stands in for the GroupServer DeploymentHandle: every request gets, per
choice, `min(max_tokens, 2)` tokens (ids 10 + step), with logprobs and prompt logprobs
when asked for, and finishes with "length": the `GroupDelta`s a group would send.
`TextGroup` answers with a chosen text instead (a tool call's, over HTTP and gRPC).

A streamed request that names its ingress's channel is answered as a group answers it:
`Accepted`, then its deltas through the group's real outboxes (workers/serving/outbox.py)
to the channel the ingress opens (`FakeChannel`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from fastapi.testclient import TestClient

from tandem.router import ingress
from tandem.router.api_key import key_digest
from tandem.router.engine_client import EngineClient
from tandem.workers.core.request import CompletionOutput, Logprob, PositionLogprobs
from tandem.workers.serving.messages import Accepted, ChannelOpen, DeltaBatch, GroupDelta, GroupRequest
from tandem.workers.serving.outbox import Outboxes

MODEL = "tiny"
MAX_MODEL_LEN = 64
# Event-loop turns a scripted delta is given to cross the channel (outbox, flush, pump, the
# request's stream) and reach the client before the script goes on: on one loop, with no
# I/O between, the same count every run, so the client sees each delta as its own chunk
# and a scripted failure after it, as a real group's slower steps would make it.
_DELIVERY_TURNS = 200


class FakeResponse:
    """Stands in for a DeploymentResponseGenerator."""

    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> GroupDelta:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        while isinstance(item, float):  # a pause (seconds) in the script
            await asyncio.sleep(item)
            item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ChannelledResponse(FakeResponse):
    """A group call of a request sent with a channel: `Accepted` (or the script's first item,
    if that is an error: the call failed before the group took it), then the scripted deltas
    go to the channel's outbox as the call is read, until the script ends or the call is
    cancelled; a scripted error fails the call itself."""

    def __init__(self, items: list, outboxes: Outboxes, request: GroupRequest) -> None:
        super().__init__(items)
        self.outboxes = outboxes
        self.request = request
        self.accepted = False

    async def __anext__(self) -> Accepted:
        await asyncio.sleep(0)
        if not self.accepted:
            if self.items and isinstance(self.items[0], BaseException):
                raise self.items.pop(0)
            self.accepted = True
            return Accepted("g0")
        while self.items and not self.cancelled:
            item = self.items.pop(0)
            if isinstance(item, float):
                await asyncio.sleep(item)
            elif isinstance(item, BaseException):
                raise item
            else:
                own = dataclasses.replace(item, request_id=self.request.request_id)
                self.outboxes.put(self.request.channel_id, own)
                for _ in range(_DELIVERY_TURNS):
                    await asyncio.sleep(0)
        raise StopAsyncIteration


class FakeChannel:
    """`GroupServer.channel` of the fake group: the real outboxes' flushes."""

    def __init__(self, outboxes: Outboxes) -> None:
        self.outboxes = outboxes
        self.opened: list[ChannelOpen] = []

    def remote(self, opened: ChannelOpen) -> AsyncIterator[DeltaBatch]:
        self.opened.append(opened)
        return self.outboxes.flushes(opened.channel_id)


def scripted_response(items: list, outboxes: Outboxes, request: GroupRequest) -> FakeResponse:
    """The call's response as a group gives it: the script itself, or over the channel."""
    if request.channel_id is None:
        return FakeResponse(items)
    return ChannelledResponse(items, outboxes, request)


class EchoGroup:
    """A DeploymentHandle whose group answers every request (or raises `fail_with` once)."""

    def __init__(self) -> None:
        self.calls: list[GroupRequest] = []
        self.fail_with: BaseException | None = None
        self.generate = self
        self.outboxes = Outboxes()
        self.channel = FakeChannel(self.outboxes)

    def options(self, **_: Any) -> EchoGroup:
        return self

    def remote(self, request: GroupRequest) -> FakeResponse:
        self.calls.append(request)
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            return scripted_response([error], self.outboxes, request)
        return scripted_response(answer(request), self.outboxes, request)


class TextGroup(EchoGroup):
    """A group whose every choice writes `pieces`, one delta each, then stops ("stop"): what a
    real model would write for a tool call, which the random-weight test models never do on demand."""

    num_prompt_tokens = 5

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    def remote(self, request: GroupRequest) -> FakeResponse:
        self.calls.append(request)
        n, pieces = request.sampling.n, self.pieces
        if request.final_only:
            pieces = ["".join(pieces)]
        deltas = []
        first_id = 10
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            ids = list(range(first_id, first_id + (len(self.pieces) if request.final_only else 1)))
            first_id += len(ids)
            outputs = [CompletionOutput(i, piece, ids, None, finish_reason="stop" if last else None) for i in range(n)]
            deltas.append(GroupDelta(request.request_id, "g0", outputs, last, num_prompt_tokens=self.num_prompt_tokens))
        return scripted_response(deltas, self.outboxes, request)


def _position(token_id: int, num_top: int) -> PositionLogprobs:
    """The chosen token (rank 1) and num_top - 1 more alternatives."""
    entry = {token_id: Logprob(-0.5, 1, f"t{token_id}")}
    for k in range(1, num_top):
        entry[token_id + 100 + k] = Logprob(-1.0 - k, k + 1, f"a{k}")
    return entry


def answer(request: GroupRequest) -> list[GroupDelta]:
    sampling = request.sampling
    prompt = request.prompt_token_ids
    num_steps = min(sampling.max_tokens or 2, 2)
    num_top = sampling.logprobs
    deltas = []
    for step in range(num_steps):
        last = step == num_steps - 1
        token = 10 + step
        outputs = [CompletionOutput(i, f"t{token}", [token],
                                    None if num_top is None else [_position(token, max(num_top, 1))],
                                    finish_reason="length" if last else None)
                   for i in range(sampling.n)]
        prompt_logprobs = None
        if step == 0 and sampling.prompt_logprobs is not None:
            prompt_logprobs = [None] + [_position(t, max(sampling.prompt_logprobs, 1)) for t in prompt[1:]]
        deltas.append(GroupDelta(request.request_id, "g0", outputs, last, num_prompt_tokens=len(prompt),
                                 prompt_logprobs=prompt_logprobs))
    return deltas


def ingress_server(model_dir: str, group: Any, **config: Any) -> Any:
    """The ingress class as written (Serve's wrapper subclasses it), built over `group`."""
    wrapper = ingress.OpenAIIngress.func_or_class
    cls = next(c for c in wrapper.__mro__[1:] if c.__name__ == "OpenAIIngress")
    if config.get("api_key"):  # as build_app hands it on: its digest only
        config["api_key_sha256"] = key_digest(config.pop("api_key"))
    return cls(group, {"model": model_dir, "served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN, **config})


@contextmanager
def serving(server: Any, *, raise_server_exceptions: bool = False) -> Iterator[TestClient]:
    """A TestClient on the ingress's FastAPI app, routed to `server` (Serve's replica context mocked)."""
    with mock.patch.object(EngineClient, "_read_group_status", return_value=(True, True)), \
            mock.patch("ray.serve.get_replica_context") as context:
        context.return_value.servable_object = server
        context.return_value.app_name = "tandem"
        # One event loop for every request, as in a replica (the ingress's channels live on it).
        with TestClient(ingress.app, raise_server_exceptions=raise_server_exceptions) as client:
            yield client


class FakeGrpcContext:
    """What GrpcMethods uses of a RayServegRPCContext."""

    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self.metadata = metadata or []
        self.code = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: list[tuple[str, str]]) -> None:
        self.trailing = metadata
