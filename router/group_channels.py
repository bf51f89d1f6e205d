"""GroupChannels: one ingress's channels to the replica groups, and the streams they feed.

A streamed request registers here before it is sent (`open`), so no delta can arrive
before there is a place for it. When its group accepts it, the ingress makes sure it has
a channel to that group (a connection to the channel socket the group named in its
`Accepted`, router/channel_socket.py; or, where it named none, one long-lived
`GroupServer.channel` call, routed by `target_group`) and reads the request's deltas from
its `ChannelStream`. A channel's pump
hands each `DeltaBatch` out by request id; a delta of a request that is gone (the client
left) is dropped. A channel that ends or fails ends every stream it feeds with
`ChannelLost`: the group is gone or unreachable, and the request may be retried elsewhere
if nothing of it was sent yet. The next request that group accepts opens a new channel.

While the ingress's router knows one group only, a streamed request for it is sent on that
group's socket channel (`submit`), not on a call of its own, whenever that channel is open;
leaving it early sends an abort there (`abort`). A `hold` call to the group stays open with
the connection, so that Serve's graceful stop of the group waits for these requests too.

Each message a stream sends costs the ingress and HAProxy the same whatever it holds, so
the streams share a budget of messages per second (`max_chunks_per_s`), split evenly
between the groups the router knows. Each request sent on a channel names its group's share
(`GroupRequest.chunks_per_s`), and the group paces the channel's streams to it
(workers/serving/outbox.py): with few streams nothing waits (a token goes out when its step
ends); with many, each stream's tokens gather in the engine between its messages, which
then cost the group, the channel and this ingress one delta each, not one a token.

Everything here runs on the ingress's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tandem.router.channel_socket import ChannelSender, read_socket_channel
from tandem.workers.serving.messages import (
    ChannelAbort,
    ChannelOpen,
    DeltaBatch,
    DeltaJoiner,
    GroupDelta,
    GroupRequest,
)

logger = logging.getLogger(__name__)


class ChannelLost(Exception):
    """The channel to a request's group ended or failed before the request did."""

    def __init__(self, message: str, group_id: str) -> None:
        super().__init__(message)
        self.group_id = group_id


# Deltas a stream may hold unread (one a step: tens of seconds of a GPU's steps). A client that
# reads slower than its tokens come would grow them without bound; past this its request ends.
MAX_UNREAD_DELTAS = 4096


class SlowReader(Exception):
    """The client read too slowly: its request was ended, its KV freed."""


class ChannelStream:
    """One request's deltas as its channel delivers them (each delta in order).

    Deltas that arrive while the reader is busy (writing to a slow client) are joined as they
    come (a `DeltaJoiner`), not queued as objects: queued objects would be walked by every
    young collection, for every stream."""

    def __init__(self, request_id: str, max_unread: int = MAX_UNREAD_DELTAS) -> None:
        self.request_id = request_id
        self.group_id: str | None = None
        # In order: deltas joined while they wait (a finish closes one), and errors.
        self._waiting: deque[DeltaJoiner | BaseException] = deque()
        self._open: DeltaJoiner | None = None  # the last of `_waiting` while later deltas may join it
        self.num_unread = 0  # deltas waiting
        self._wakeup: asyncio.Future | None = None  # the reader's, while it waits for a delta
        self._any_put = False
        self._max_unread = max_unread
        self._reader: asyncio.Task | None = None  # the task that reads this stream (the response's)
        self.overflowed = False
        self.sent_on_channel = False  # the request went on the channel (GroupChannels.submit), not a call

    def put(self, item: GroupDelta | BaseException) -> None:
        if self.overflowed:
            return
        if self.num_unread >= self._max_unread:
            # The reader is stuck writing to a client that does not read (it never comes back
            # for these): drop them, and cancel it, which ends the request (its group call is
            # cancelled: the group aborts it and frees its KV) and the client's connection.
            self.overflowed = True
            self._waiting.clear()
            self._open = None
            self.num_unread = 0
            self._waiting.append(SlowReader(f"request {self.request_id}: the client left more than "
                                            f"{self._max_unread} deltas unread"))
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            return
        if isinstance(item, BaseException):
            self._waiting.append(item)
            self._open = None
        elif self._open is not None:
            self._open.add(item)
            self.num_unread += 1
            if item.finished:  # the finish stays the last thing a message says
                self._open = None
        else:
            joiner = DeltaJoiner(item)
            self._waiting.append(joiner)
            self.num_unread += 1
            # The first delta goes alone, at once (time to first token): nothing joins it.
            self._open = joiner if self._any_put and not item.finished else None
            self._any_put = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def next(self) -> GroupDelta:
        """The next delta, joined with every later one that came while the reader was busy:
        one message for the client however many arrived meanwhile (a finish or an error stays
        the last thing it says; the first delta goes alone)."""
        self._reader = asyncio.current_task()
        while not self._waiting:
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        head = self._waiting.popleft()
        if isinstance(head, BaseException):
            raise head
        if self._open is head:
            self._open = None
        self.num_unread -= head.count
        return head.result()


class GroupChannels:
    def __init__(self, handle: Any, max_chunks_per_s: float = 0.0,
                 num_groups: Callable[[], int] = lambda: 1) -> None:
        """`handle`: the groups' deployment handle, streaming. `max_chunks_per_s` (0: no bound):
        the messages a second this ingress sends, all streams together, split between the
        `num_groups()` groups there are now (see `chunks_per_s`)."""
        self._handle = handle
        self.max_chunks_per_s = max_chunks_per_s
        self._num_groups = num_groups
        # This ingress process, to every group; unguessable: it is all a channel socket asks for.
        self.channel_id = f"ingress-{secrets.token_hex(16)}"
        self._streams: dict[str, ChannelStream] = {}
        self._pumps: dict[str, asyncio.Task] = {}  # group id -> its channel's pump
        self._senders: dict[str, ChannelSender] = {}  # group id -> its socket channel's connection
        self._holds: dict[str, asyncio.Task] = {}  # group id -> its `hold` call
        self._sent: Counter[str] = Counter()  # group id -> requests sent on its channel, in flight
        self.num_batches = 0
        self.num_deltas = 0
        self.num_sent = 0  # requests sent on a channel (not a call)

    def open(self, request_id: str) -> ChannelStream:
        """A stream for a request about to be sent; ValueError if that id is already in flight."""
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        stream = self._streams[request_id] = ChannelStream(request_id)
        return stream

    def chunks_per_s(self) -> float:
        """One group's share of the budget, for the requests sent there now (0: no bound). The
        group gives each of the channel's streams an equal part of it, so every stream of this
        ingress gets about `streams / max_chunks_per_s` seconds between its messages."""
        if not self.max_chunks_per_s:
            return 0.0
        return self.max_chunks_per_s / max(1, self._num_groups())

    def with_channel(self, request: GroupRequest) -> GroupRequest:
        """`request` as it goes to a group with its deltas on this ingress's channel."""
        return replace(request, channel_id=self.channel_id, chunks_per_s=self.chunks_per_s())

    def accepted(self, stream: ChannelStream, group_id: str, address: tuple[str, int] | None = None) -> None:
        """Its group took the request: read that group's channel (opened now if it is not open),
        at the group's channel socket `address` (None: over a `GroupServer.channel` call)."""
        stream.group_id = group_id
        pump = self._pumps.get(group_id)
        loop = asyncio.get_running_loop()
        if pump is None or pump.done() or pump.get_loop() is not loop:
            self._pumps[group_id] = loop.create_task(self._pump(group_id, address))

    def close(self, stream: ChannelStream, *, abort: bool = False) -> None:
        """The stream's request ended, or its reader left it (`abort`: a request sent on the
        channel is aborted in its group)."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if stream.sent_on_channel and stream.group_id is not None:
                self._sent[stream.group_id] -= 1
                self._sent += Counter()  # drop groups at zero
                sender = self._senders.get(stream.group_id)
                if abort and sender is not None:
                    sender.send(ChannelAbort(stream.request_id))

    # ---- requests sent on a channel ------------------------------------------------------------
    def sender(self, group_id: str) -> ChannelSender | None:
        """The group's socket channel, where it is open now (requests may go on it)."""
        sender = self._senders.get(group_id)
        return sender if sender is not None and sender.open else None

    def num_sent_to(self, group_id: str) -> int:
        """Requests sent on the group's channel and not yet ended."""
        return self._sent[group_id]

    def submit(self, request: GroupRequest, group_id: str, sender: ChannelSender) -> ChannelStream | None:
        """Send a streamed request on the group's channel; its stream, or None when the channel
        closed meanwhile (nothing was sent)."""
        stream = self.open(request.request_id)
        stream.group_id = group_id
        if not sender.send(self.with_channel(request)):
            self.close(stream)
            return None
        stream.sent_on_channel = True
        self._sent[group_id] += 1
        self.num_sent += 1
        hold = self._holds.get(group_id)
        if hold is None or hold.done():
            self._holds[group_id] = asyncio.get_running_loop().create_task(self._hold(group_id))
        return stream

    async def _hold(self, group_id: str) -> None:
        """The group's `hold` call, open until the channel's connection ends (or this is cancelled)."""
        try:
            async for _ in self._handle.hold.remote(ChannelOpen(group_id, self.channel_id)):
                pass
        except Exception as exc:  # noqa: BLE001 - the channel itself says what happened to the group
            logger.debug("replica group %s: its hold call ended: %s", group_id, type(exc).__name__)

    async def _pump(self, group_id: str, address: tuple[str, int] | None) -> None:
        me = asyncio.current_task()
        reason = "its channel ended"
        try:
            while await self._read_channel(group_id, address):
                # Closed for being idle: open again at once if a request came meanwhile.
                if not any(s.group_id == group_id for s in self._streams.values()):
                    return
        except asyncio.CancelledError:
            reason = "the ingress is stopping"
            raise
        except Exception as exc:  # noqa: BLE001 - the group is gone: its streams are told
            reason = f"its channel failed: {type(exc).__name__}"
        finally:
            if self._pumps.get(group_id) is me:
                del self._pumps[group_id]
            hold = self._holds.pop(group_id, None)
            if hold is not None:
                hold.cancel()
            lost = [s for s in self._streams.values() if s.group_id == group_id]
            if lost:
                logger.warning("replica group %s: %s; ending its %d streams", group_id, reason, len(lost))
            for stream in lost:
                stream.put(ChannelLost(reason, group_id))

    async def _read_channel(self, group_id: str, address: tuple[str, int] | None) -> bool:
        """One connection (or call) of the channel, read to its end; True when the group closed it
        for being idle (False: it ended without saying so: the group is gone)."""
        opened = ChannelOpen(group_id, self.channel_id)
        if address is not None:
            try:
                return await read_socket_channel(address, opened, self._hand_out,
                                                 lambda sender: self._senders.__setitem__(group_id, sender))
            finally:  # the connection is gone, however it ended: nothing more goes on it
                self._senders.pop(group_id, None)
        async for batch in self._handle.channel.remote(opened):
            self._hand_out(batch)
            if batch.closing:
                return True
        return False

    def _hand_out(self, batch: DeltaBatch) -> None:
        self.num_batches += 1
        self.num_deltas += len(batch.deltas)
        for delta in batch.deltas:
            stream = self._streams.get(delta.request_id)
            # group_id None: the delta came before the request's acceptance did (another call).
            if stream is not None and stream.group_id in (None, delta.group_id):
                stream.put(delta)

    async def shutdown(self) -> None:
        tasks = list(self._pumps.values()) + list(self._holds.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
