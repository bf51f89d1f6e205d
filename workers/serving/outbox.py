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

Each channel's streams share the budget of messages a second its ingress names on every
request (`GroupRequest.chunks_per_s`): the channel has one `OutputPace`
(workers/core/output_pace.py) whose interval is its streams over that budget, and the
engine makes a paced request's output at most once per interval, so under load a step
brings deltas of a few of the channel's streams, each saying several tokens.

The engine's thread hands each step's deltas over itself (`put_step`), without a turn of the
event loop: to a channel whose socket connection is attached (`Sink`, channel_server.py) and
has nothing waiting, it writes them as one frame at once; otherwise they wait in the outbox
and the loop is woken once. Everything that reaches a channel's byte stream, from either
thread, passes one lock, and the engine's thread writes only while no earlier delta waits and
the loop has nothing of the channel's in hand: so a channel's deltas leave in the order they
were put. So on the served path the loop does no work per token and takes no turn of the GIL
per step; it flushes what waits (a connection that reads slowly, the first deltas before a
connection opens, the Serve-call channels).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Protocol

from tandem.workers.core.output_pace import OutputPace
from tandem.workers.serving.messages import DeltaBatch, GroupDelta


class Sink(Protocol):
    """A channel's connection, as the engine's thread writes to it (called under the lock)."""

    busy: int  # the loop holds deltas of the channel it has not written yet: nothing may pass them

    def ready(self) -> bool:
        """Nothing of the connection's waits to be written (a frame written now goes next)."""

    def send(self, batch: DeltaBatch) -> None:
        """Write `batch` as the connection's next frame; what the socket does not take at once
        the connection writes before anything else (it is busy until then)."""


class _Outbox:
    __slots__ = ("deltas", "ready", "closed", "sink")

    def __init__(self) -> None:
        self.deltas: list[GroupDelta] = []
        self.ready = asyncio.Event()
        self.closed = False  # a newer call of the same channel took over
        self.sink: Sink | None = None  # the channel's socket connection, while one reads it


class Outboxes:
    """The outboxes of one group, by channel id: the event loop's, but for `put_step`, which the
    engine's thread calls (the boxes' deltas and sinks are touched under `lock`)."""

    def __init__(self, idle_s: float = 1.0, min_interval_s: float = 0.0) -> None:
        """`min_interval_s`: the least time between two outputs of a stream after its first,
        whatever its channel's budget (the group's `stream_interval_ms`)."""
        self._boxes: dict[str, _Outbox] = {}
        self._running: dict[str, int] = {}  # requests in flight per channel (the loop's alone)
        self._paces: dict[str, OutputPace] = {}  # per channel: its streams' (read by the engine's thread)
        self._budgets: dict[str, float] = {}  # per channel: messages a second, as its ingress last said
        self.min_interval_s = min_interval_s
        self.lock = threading.Lock()  # the boxes' deltas and sinks, and what a sink writes
        self._loop: asyncio.AbstractEventLoop | None = None  # the flushes' loop, from the first one
        self.idle_s = idle_s
        self.num_flushes = 0
        self.num_deltas = 0
        self.num_direct = 0  # frames the engine's thread wrote itself

    def begin(self, channel_id: str, chunks_per_s: float = 0.0) -> OutputPace:
        """A request whose deltas go to `channel_id` started: the channel stays open until it ends.
        `chunks_per_s`: the messages a second its ingress takes on this channel, all streams
        together (0: no bound). Returns the pace of the channel's streams, for the engine."""
        self._running[channel_id] = self._running.get(channel_id, 0) + 1
        self._budgets[channel_id] = chunks_per_s
        return self._repace(channel_id)

    def end(self, channel_id: str) -> None:
        left = self._running.get(channel_id, 0) - 1
        if left > 0:
            self._running[channel_id] = left
            self._repace(channel_id)
        else:
            self._running.pop(channel_id, None)
            self._paces.pop(channel_id, None)  # the engine may still hold it: it is only read
            self._budgets.pop(channel_id, None)

    def _repace(self, channel_id: str) -> OutputPace:
        """The channel's streams share its budget: each makes at most one output per `streams /
        budget` seconds (and `min_interval_s`). Under load a stream's tokens gather into fewer,
        larger messages, so the cost of the path stops growing with streams x steps; one
        stream, or a few, waits for nothing (its interval is shorter than a step)."""
        pace = self._paces.get(channel_id)
        if pace is None:
            pace = self._paces[channel_id] = OutputPace()
        budget = self._budgets.get(channel_id, 0.0)
        shared = self._running.get(channel_id, 0) / budget if budget > 0 else 0.0
        pace.interval_s = max(self.min_interval_s, shared)  # one float's store: the engine reads it any time
        return pace

    def put(self, channel_id: str, delta: GroupDelta) -> None:
        """One delta, from the event loop."""
        with self.lock:
            box = self._boxes.get(channel_id)
            if box is None:
                box = self._boxes[channel_id] = _Outbox()
            box.deltas.append(delta)
        box.ready.set()

    def put_step(self, deltas: dict[str, list[GroupDelta]]) -> None:
        """One engine step's deltas by channel, from the engine's thread (see the module)."""
        wake = []
        with self.lock:
            for channel_id, news in deltas.items():
                box = self._boxes.get(channel_id)
                if box is None:
                    box = self._boxes[channel_id] = _Outbox()
                sink = box.sink
                if sink is not None and not box.deltas and not sink.busy and sink.ready():
                    self.num_flushes += 1
                    self.num_deltas += len(news)
                    self.num_direct += 1
                    sink.send(DeltaBatch(news))
                    continue
                if not box.deltas:
                    wake.append(box)
                box.deltas.extend(news)
            loop = self._loop
        if loop is not None:  # else no flush has started: the first one takes what waits
            for box in wake:
                try:
                    loop.call_soon_threadsafe(box.ready.set)
                except RuntimeError:  # the loop has closed: the replica is stopping
                    return

    async def flushes(self, channel_id: str, sink: Sink | None = None) -> AsyncIterator[DeltaBatch]:
        """Everything put for `channel_id`, one batch per wake-up, until the caller stops.
        With `sink` (the channel's socket connection), the engine's thread writes to it
        directly while nothing waits; a batch yielded here holds it busy until the caller
        asks for the next one, having written it.

        A second call for the same channel (its ingress reopened it) takes over: the first
        one ends, and what waited goes out on the second."""
        box = _Outbox()
        box.sink = sink
        with self.lock:
            self._loop = asyncio.get_running_loop()
            old = self._boxes.get(channel_id)
            if old is not None:
                box.deltas, old.deltas = old.deltas, []
                old.closed = True
                old.sink = None
                old.ready.set()
            if box.deltas:
                box.ready.set()
            self._boxes[channel_id] = box
        try:
            while True:
                try:
                    await asyncio.wait_for(box.ready.wait(), self.idle_s)
                except TimeoutError:
                    with self.lock:
                        closing = not box.deltas and channel_id not in self._running
                        if closing:
                            # Unlisted first: a delta put while the last batch goes out starts a
                            # new box, and the engine's thread writes nothing after the close.
                            del self._boxes[channel_id]
                            box.sink = None
                    if closing:
                        yield DeltaBatch([], closing=True)
                        return
                    continue
                if box.closed:
                    return
                box.ready.clear()
                with self.lock:
                    deltas, box.deltas = box.deltas, []
                    held = box.sink
                    if held is not None and deltas:
                        held.busy += 1
                    if deltas:
                        self.num_flushes += 1
                        self.num_deltas += len(deltas)
                if not deltas:  # a late wake-up: the engine's thread wrote them itself
                    continue
                try:
                    yield DeltaBatch(deltas)
                finally:
                    if held is not None:
                        with self.lock:
                            held.busy -= 1
        finally:
            with self.lock:
                box.sink = None
                if self._boxes.get(channel_id) is box:
                    del self._boxes[channel_id]

    def __len__(self) -> int:
        return len(self._boxes)
