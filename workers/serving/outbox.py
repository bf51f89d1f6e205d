"""Outboxes: a group's streamed deltas, gathered per ingress channel and flushed as one message.

Each streamed request names its ingress's channel (`GroupRequest.channel_id`); its deltas
wait in that channel's outbox until the channel's call (`GroupServer.channel`) sends them.
A flush takes everything waiting, so the batching adapts by itself: the engine hands a
step's outputs to the event loop together, so at low load a token leaves as soon as its
step ends (one stream adds no latency), and while the loop is busy (sending, serving other
calls) deltas pile up and the next flush carries all of them. The cost of the path is then
per step and channel, not per token and stream.

An outbox exists from the first delta or the channel's opening, whichever comes first (a
request's first token can be ready before its ingress has opened the channel), until the
channel closes.

A channel carrying no request for `idle_s` closes itself with a last, empty `closing`
batch: a call that never ends would hold the replica's graceful shutdown (Serve waits for
every call) for its whole timeout. The ingress opens it again with its next request there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tandem.workers.serving.messages import DeltaBatch, GroupDelta


class _Outbox:
    def __init__(self) -> None:
        self.deltas: list[GroupDelta] = []
        self.ready = asyncio.Event()
        self.closed = False  # a newer call of the same channel took over


class Outboxes:
    """The outboxes of one group, by channel id (touched on the group's event loop only)."""

    def __init__(self, idle_s: float = 1.0) -> None:
        self._boxes: dict[str, _Outbox] = {}
        self._running: dict[str, int] = {}  # requests in flight per channel
        self.idle_s = idle_s
        self.num_flushes = 0
        self.num_deltas = 0

    def begin(self, channel_id: str) -> None:
        """A request whose deltas go to `channel_id` started: the channel stays open until it ends."""
        self._running[channel_id] = self._running.get(channel_id, 0) + 1

    def end(self, channel_id: str) -> None:
        left = self._running.get(channel_id, 0) - 1
        if left > 0:
            self._running[channel_id] = left
        else:
            self._running.pop(channel_id, None)

    def put(self, channel_id: str, delta: GroupDelta) -> None:
        box = self._boxes.get(channel_id)
        if box is None:
            box = self._boxes[channel_id] = _Outbox()
        box.deltas.append(delta)
        box.ready.set()

    async def flushes(self, channel_id: str) -> AsyncIterator[DeltaBatch]:
        """Everything put for `channel_id`, one batch per wake-up, until the caller stops.

        A second call for the same channel (its ingress reopened it) takes over: the first
        one ends, and what waited goes out on the second."""
        box = _Outbox()
        old = self._boxes.get(channel_id)
        if old is not None:
            box.deltas, old.deltas = old.deltas, []
            old.closed = True
            old.ready.set()
        if box.deltas:
            box.ready.set()
        self._boxes[channel_id] = box
        try:
            while True:
                try:
                    await asyncio.wait_for(box.ready.wait(), self.idle_s)
                except TimeoutError:
                    if not box.deltas and channel_id not in self._running:
                        # Unlisted first: a delta put while the last batch goes out starts a new box.
                        del self._boxes[channel_id]
                        yield DeltaBatch([], closing=True)
                        return
                    continue
                if box.closed:
                    return
                box.ready.clear()
                deltas, box.deltas = box.deltas, []
                self.num_flushes += 1
                self.num_deltas += len(deltas)
                yield DeltaBatch(deltas)
        finally:
            if self._boxes.get(channel_id) is box:
                del self._boxes[channel_id]

    def __len__(self) -> int:
        return len(self._boxes)
