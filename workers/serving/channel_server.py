"""ChannelServer: a group's channel socket, where its ingresses read their streams' deltas.

One TCP listener per group, on its node's address (a free port, named to each ingress in
`Accepted`). An ingress connects once per group and says which channel it reads with one
hello frame (`ChannelOpen` as JSON); from then on the group writes that channel's outbox
(outbox.py) to it, one frame per flush (`encode_batch`): a 4-byte big-endian length, then
the pickled batch. The first frame, an empty batch, says the group took the hello.

The ingress may then send requests for the group to run on the channel, and aborts of them
(`encode_channel_message` frames), which the group hands to its `ChannelRequests`; the
ingress hanging up ends the flushes at once and aborts every request sent on the channel.
When the group closes an idle channel (its outbox's `closing` batch), what the ingress sent
meanwhile is still read, until it hangs up: a request that crossed the closing runs, and
its deltas wait in the outbox for the channel's next connection.

Against a Serve streaming call per channel this costs a `write` per flush: no object ref,
no generator report, no deserialization on another thread in the ingress (figures in
bench/RESULTS.md). The group never unpickles what a connection sends (the hello is JSON,
bounded in size and time), nor anything on a channel whose id did not first reach it
through Ray (a request's `channel_id` on a Serve call): a stranger who reaches the port can
read nothing but a channel whose 128-bit random id it knows, and can hurt nothing.

Everything here runs on the group's event loop but a connection's `SocketSink`, through
which the engine's thread writes a step's deltas itself while nothing of the channel waits
(outbox.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
from contextlib import aclosing, suppress
from typing import Protocol

from tandem.workers.serving.messages import (
    ChannelAbort,
    ChannelOpen,
    DeltaBatch,
    GroupRequest,
    decode_channel_message,
    encode_batch,
)
from tandem.workers.serving.outbox import Outboxes

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_HELLO_BYTES = 4096
HEADER_BYTES = 4
# A request's frame: its prompt's token ids and sampling options (a long prompt is a few MB).
MAX_MESSAGE_BYTES = 64 << 20


class ChannelRequests(Protocol):
    """What a group does with the requests an ingress sends on its channel (GroupServer)."""

    def accepts(self, channel_id: str) -> bool:
        """Whether `channel_id` came through Ray (a Serve call named it): only then is what its
        connection sends read."""

    def submit(self, request: GroupRequest) -> None:
        """Run `request`, its deltas to the outbox of its `channel_id`."""

    def abort(self, request_id: str) -> None:
        """End a request sent on a channel (nothing if it ended already)."""

    def lost(self, channel_id: str) -> None:
        """The channel's ingress hung up: abort every request sent on it."""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


_READY = frame(encode_batch(DeltaBatch([])))  # a connection's first frame: the group took its hello


def hello(opened: ChannelOpen) -> bytes:
    """The one frame an ingress sends: the channel it reads, and the group it means."""
    return frame(json.dumps({"target_group": opened.target_group, "channel_id": opened.channel_id}).encode())


def tune(sock: socket.socket | None) -> None:
    """No Nagle delay (a flush is a whole message), and keepalive probes: a peer whose node
    died without closing the connection is found within ~25 s."""
    if sock is None:
        return
    with suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


async def _read_hello(reader: asyncio.StreamReader) -> ChannelOpen:
    """The connection's hello; ValueError for anything else (too long, not JSON, wrong keys)."""
    size = int.from_bytes(await reader.readexactly(HEADER_BYTES), "big")
    if size > MAX_HELLO_BYTES:
        raise ValueError(f"a hello of {size} bytes")
    fields = json.loads(await reader.readexactly(size))
    if not isinstance(fields, dict) or set(fields) != {"target_group", "channel_id"} \
            or not all(isinstance(v, str) for v in fields.values()):
        raise ValueError("not a channel hello")
    return ChannelOpen(fields["target_group"], fields["channel_id"])


class SocketSink:
    """A connection's socket as the engine's thread writes to it (`outbox.Sink`; called under
    the outboxes' lock). It writes through a duplicate of the connection's descriptor, so the
    transport closing its own never leaves that thread a number the process may reuse; the
    duplicate closes when the connection ends, after the outbox let go of the sink. What the
    socket does not take at once (an ingress that reads slowly) the event loop writes through
    the transport before anything else of the channel."""

    def __init__(self, writer: asyncio.StreamWriter, lock: threading.Lock) -> None:
        self.busy = 0
        self._transport = writer.transport
        self._lock = lock
        self._loop = asyncio.get_running_loop()
        self._sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
        self._sock.setblocking(False)
        self._rest = b""

    def ready(self) -> bool:
        return self._transport.get_write_buffer_size() == 0 and not self._transport.is_closing()

    def send(self, batch: DeltaBatch) -> None:
        payload = frame(encode_batch(batch))
        try:
            sent = self._sock.send(payload)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the connection broke: its reader ends, and the ingress fails its streams
            return
        if sent < len(payload):
            self._rest = payload[sent:]
            self.busy += 1
            with suppress(RuntimeError):  # the loop closed: the replica is stopping
                self._loop.call_soon_threadsafe(self.write_rest)

    def write_rest(self) -> None:
        """On the loop: the end of a frame the socket did not take, before anything else."""
        with self._lock:
            if self._rest:
                self._transport.write(self._rest)
                self._rest = b""
                self.busy -= 1

    def close(self) -> None:
        with self._lock:
            self._rest = b""
            self._sock.close()


class ChannelServer:
    def __init__(self, group_id: str, outboxes: Outboxes, requests: ChannelRequests | None = None) -> None:
        """`requests`: where requests sent on a channel go (None: a connection that sends more
        than its hello is hanging up)."""
        self.group_id = group_id
        self.outboxes = outboxes
        self.requests = requests
        self.address: tuple[str, int] | None = None
        self.num_refused = 0  # connections that did not say a proper hello for this group
        self.num_messages = 0  # requests and aborts read from the ingresses
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # the connections open now
        self._open: dict[str, asyncio.Event] = {}  # channel id -> set when its connection ends
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str) -> tuple[str, int]:
        """Listen on `host` (the node's address), a free port; returns (host, port)."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, host, 0)
        self.address = (host, self._server.sockets[0].getsockname()[1])
        return self.address

    def close(self) -> None:
        """Stop listening and drop every connection (the ingresses end the streams they fed).
        Callable from any thread (a replica's shutdown)."""
        if self._server is None or self._loop is None or self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._close()
        else:
            with suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def connection_ended(self, channel_id: str) -> None:
        """Return when the connection of `channel_id` open now ends (at once if none is)."""
        ended = self._open.get(channel_id)
        if ended is not None:
            await ended.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tune(writer.get_extra_info("socket"))
        self._writers.add(writer)
        try:
            try:
                opened = await asyncio.wait_for(_read_hello(reader), HELLO_TIMEOUT_S)
            except (TimeoutError, ValueError, asyncio.IncompleteReadError, OSError) as exc:
                self.num_refused += 1
                logger.warning("channel socket: refused a connection from %s (%s)",
                               writer.get_extra_info("peername"), type(exc).__name__)
                return
            if opened.target_group != self.group_id:  # an old address of another group: nothing
                self.num_refused += 1
                return
            ended = self._open[opened.channel_id] = asyncio.Event()
            try:
                await self._write_flushes(opened.channel_id, reader, writer)
            finally:
                ended.set()
                if self._open.get(opened.channel_id) is ended:
                    del self._open[opened.channel_id]
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _write_flushes(self, channel_id: str, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        """The channel's flushes, until the outbox closes it (idle) or the ingress hangs up;
        what the ingress sends is read meanwhile."""
        loop = asyncio.get_running_loop()
        writer.write(_READY)
        reading = loop.create_task(self._read_all(channel_id, reader))
        writing = loop.create_task(self._write_all(channel_id, writer))
        closed = False  # by the group (idle, or a newer connection of the channel took over)
        try:
            done, _ = await asyncio.wait({reading, writing}, return_when=asyncio.FIRST_COMPLETED)
            closed = writing in done and writing.exception() is None
            if closed and not reading.done():
                # A request the ingress sent as the channel closed still runs: read on until it
                # hangs up (it does when it reads the closing batch).
                with suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reading), HELLO_TIMEOUT_S)
        finally:
            for task in (reading, writing):
                task.cancel()
            await asyncio.gather(reading, writing, return_exceptions=True)
            if not closed and self.requests is not None:
                self.requests.lost(channel_id)

    async def _read_all(self, channel_id: str, reader: asyncio.StreamReader) -> None:
        """What the ingress sends, until it hangs up (or sends what is not a channel message)."""
        requests = self.requests
        while True:
            try:
                header = await reader.readexactly(HEADER_BYTES)
            except (asyncio.IncompleteReadError, OSError):
                return  # hung up
            size = int.from_bytes(header, "big")
            if requests is None or size > MAX_MESSAGE_BYTES or not requests.accepts(channel_id):
                return
            try:
                message = decode_channel_message(await reader.readexactly(size))
            except Exception as exc:  # noqa: BLE001 - a broken connection, never the group
                logger.warning("channel socket: dropped channel %s's connection (%s)", channel_id[:16],
                               type(exc).__name__)
                return
            self.num_messages += 1
            if isinstance(message, ChannelAbort):
                requests.abort(message.request_id)
            elif message.channel_id != channel_id:
                logger.warning("channel socket: a request for another channel on channel %s", channel_id[:16])
                return
            else:
                requests.submit(message)

    async def _write_all(self, channel_id: str, writer: asyncio.StreamWriter) -> None:
        sink = SocketSink(writer, self.outboxes.lock)
        try:
            async with aclosing(self.outboxes.flushes(channel_id, sink)) as flushes:
                async for batch in flushes:
                    sink.write_rest()  # a frame the engine's thread began goes first
                    writer.write(frame(encode_batch(batch)))
                    await writer.drain()  # an ingress that reads slowly: the next flush gathers more
        finally:
            sink.close()
