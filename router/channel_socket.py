"""Reading one channel from a group's channel socket (workers/serving/channel_server.py).

A protocol, not a stream reader: the frames of a flush are cut out of what arrived and
handed on in the same callback, with no task or await per frame. Once the group's first
frame has come (it took the hello), the connection is handed to `on_ready` as a
`ChannelSender`: requests and aborts for the group go on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.workers.serving.channel_server import HEADER_BYTES, frame, hello, tune
from tandem.workers.serving.messages import (
    ChannelMessage,
    ChannelOpen,
    DeltaBatch,
    decode_batch,
    encode_channel_message,
)

# A frame this large is no batch of a group's: the connection is broken, not the batch.
MAX_FRAME_BYTES = 1 << 30


class ChannelSender:
    """The ingress's side of a channel's connection, for sending to the group."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False  # the group took the hello, and has not closed the channel

    def send(self, message: ChannelMessage) -> bool:
        """Send `message`; False when the connection is not open (nothing was sent)."""
        if not self.open or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(frame(encode_channel_message(message)))
        return True


class _ChannelReader(asyncio.Protocol):
    def __init__(self, on_batch: Callable[[DeltaBatch], None], ended: asyncio.Future,
                 on_ready: Callable[[ChannelSender], None]) -> None:
        self._on_batch = on_batch
        self._ended = ended  # True: the group closed the channel for being idle; False: it just ended
        self._buffer = bytearray()
        self._on_ready = on_ready
        self.sender = ChannelSender()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sender.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while len(buffer) - start >= HEADER_BYTES:
                size = int.from_bytes(buffer[start:start + HEADER_BYTES], "big")
                if size > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {size} bytes")
                end = start + HEADER_BYTES + size
                if len(buffer) < end:
                    break
                batch = decode_batch(bytes(buffer[start + HEADER_BYTES:end]))
                start = end
                if not self.sender.open and not batch.closing and not self._ended.done():
                    self.sender.open = True  # the first frame: the group took the hello
                    self._on_ready(self.sender)
                self._on_batch(batch)
                if batch.closing:
                    self._end(True)
                    return
        except Exception as exc:  # noqa: BLE001 - a broken stream fails the channel, not the loop
            self._end(exc)
            return
        finally:
            del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc if exc is not None else False)

    def _end(self, result: bool | BaseException) -> None:
        self.sender.open = False
        if not self._ended.done():
            if isinstance(result, BaseException):
                self._ended.set_exception(result)
            else:
                self._ended.set_result(result)
        if self.sender.transport is not None:
            self.sender.transport.close()


async def read_socket_channel(address: tuple[str, int], opened: ChannelOpen,
                              on_batch: Callable[[DeltaBatch], None],
                              on_ready: Callable[[ChannelSender], None] = lambda sender: None) -> bool:
    """Read the channel at `address` to its end, each batch to `on_batch`; True when the group
    closed it for being idle, False when it ended without saying so. A refused or broken
    connection raises (OSError, ValueError)."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[bool] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _ChannelReader(on_batch, ended, on_ready), *address)
    try:
        tune(transport.get_extra_info("socket"))
        transport.write(hello(opened))
        return await ended
    finally:
        transport.close()
