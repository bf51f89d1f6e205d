"""A group's channel socket and an ingress reading it, over real TCP on loopback: each
stream gets its own deltas in order across frames, an idle channel closes and reopens,
a group that goes away ends exactly its streams, the ingress hanging up ends the group's
writing at once, and a connection that does not say a proper hello gets nothing.
Requests sent on the channel reach the group (and aborts of them), only on a channel the
group heard of through Ray; a broken frame ends the connection and its requests; a request
that crosses the idle close still runs."""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import threading
from dataclasses import replace

import pytest

from tandem.router.group_channels import ChannelLost, GroupChannels
from tandem.workers.core.request import CompletionOutput, SamplingParams
from tandem.workers.serving import channel_server
from tandem.workers.serving.channel_server import ChannelServer, frame, hello
from tandem.workers.serving.messages import (
    ChannelOpen,
    DeltaBatch,
    GroupDelta,
    GroupRequest,
    decode_batch,
    encode_batch,
    encode_channel_message,
)
from tandem.workers.serving.outbox import Outboxes
from tests.unit.router.test_group_channels import delta

HOST = "127.0.0.1"


class NoServeHandle:
    """The groups' handle: a channel over a socket never calls it."""

    @property
    def channel(self):
        raise AssertionError("a channel with a socket address made a Serve call")


async def until(condition, timeout_s: float = 5.0) -> None:
    """Wait for `condition()` (real I/O in between: loopback sockets)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


async def group(name: str = "g0", idle_s: float = 30.0) -> tuple[Outboxes, ChannelServer, tuple[str, int]]:
    outboxes = Outboxes(idle_s=idle_s)
    server = ChannelServer(name, outboxes)
    return outboxes, server, await server.start(HOST)


async def read_frame(reader: asyncio.StreamReader) -> DeltaBatch:
    header = await reader.readexactly(4)
    return decode_batch(await reader.readexactly(int.from_bytes(header, "big")))


def test_a_batch_survives_its_encoding_whole() -> None:
    batch = DeltaBatch([delta("a", 1, logprobs=True), GroupDelta.failure("b", "g0", "no", "invalid_request")],
                       closing=True)
    assert decode_batch(encode_batch(batch)) == batch


def test_each_stream_gets_its_own_deltas_in_order_over_the_socket() -> None:
    async def run() -> list:
        outboxes, server, address = await group()
        channels = GroupChannels(NoServeHandle())
        streams = {r: channels.open(r) for r in ("r0", "r1")}
        for s in streams.values():
            outboxes.begin(channels.channel_id)
            channels.accepted(s, "g0", address)
        # Many flushes, some large (a frame cut across reads), the two streams interleaved.
        for step in range(40):
            outboxes.put(channels.channel_id, delta("r0", step, logprobs=True))
            outboxes.put(channels.channel_id, delta("r1", 1000 + step, index=step % 2))
            if step % 8 == 0:
                await asyncio.sleep(0.002)
        outboxes.put(channels.channel_id, delta("r0", 99, finish="stop"))
        outboxes.put(channels.channel_id, delta("r1", 1099, finish="length"))
        got: dict[str, list] = {}
        for r, s in streams.items():
            tokens: list[int] = []
            while True:
                d = await s.next()
                for o in d.outputs:
                    tokens.extend(o.token_ids)
                if d.finished:
                    break
            got[r] = tokens
        server.close()
        return [got["r0"], sorted(got["r1"]), channels.num_deltas, server.num_refused]

    r0, r1, num_deltas, refused = asyncio.run(run())
    assert r0 == list(range(40)) + [99]
    assert r1 == [1000 + s for s in range(40)] + [1099]
    assert (num_deltas, refused) == (82, 0)


def test_an_idle_channel_closes_and_reopens_for_the_next_request() -> None:
    async def run() -> list:
        outboxes, server, address = await group(idle_s=0.05)
        channels = GroupChannels(NoServeHandle())
        a = channels.open("a")
        channels.accepted(a, "g0", address)
        outboxes.put(channels.channel_id, delta("a", 1, finish="stop"))
        first = await a.next()
        channels.close(a)
        await until(lambda: len(outboxes) == 0)  # idle: the group closed it, the ingress let it go
        await until(lambda: not channels._pumps)
        b = channels.open("b")
        channels.accepted(b, "g0", address)
        outboxes.put(channels.channel_id, delta("b", 2, finish="stop"))
        second = await b.next()
        server.close()
        return [first.outputs[0].token_ids, second.outputs[0].token_ids]

    assert asyncio.run(run()) == [[1], [2]]


def test_a_group_that_goes_away_ends_its_streams_and_no_others() -> None:
    async def run() -> list:
        outboxes0, server0, address0 = await group("g0")
        outboxes1, server1, address1 = await group("g1")
        channels = GroupChannels(NoServeHandle())
        a, b = channels.open("a"), channels.open("b")
        outboxes0.begin(channels.channel_id)
        outboxes1.begin(channels.channel_id)
        channels.accepted(a, "g0", address0)
        channels.accepted(b, "g1", address1)
        outboxes0.put(channels.channel_id, delta("a", 1))
        await a.next()
        server0.close()  # as the group's process ending closes its connections
        with pytest.raises(ChannelLost) as info:
            await asyncio.wait_for(a.next(), 5)
        outboxes1.put(channels.channel_id, delta("b", 7, group="g1"))
        got = (await b.next()).outputs[0].token_ids
        server1.close()
        return [info.value.group_id, got]

    assert asyncio.run(run()) == ["g0", [7]]


def test_an_unreachable_group_fails_its_streams_at_once() -> None:
    async def run() -> tuple[str, str]:
        _, server, address = await group()
        server.close()
        await asyncio.sleep(0.01)
        channels = GroupChannels(NoServeHandle())
        a = channels.open("a")
        channels.accepted(a, "g0", address)  # nothing listens there any more
        with pytest.raises(ChannelLost) as info:
            await asyncio.wait_for(a.next(), 5)
        return info.value.group_id, str(info.value)

    group_id, reason = asyncio.run(run())
    assert group_id == "g0" and reason.startswith("its channel failed: ") and "Connection" in reason


def test_the_ingress_hanging_up_ends_the_groups_writing_and_frees_its_outbox() -> None:
    async def run() -> list:
        outboxes, server, address = await group()
        outboxes.begin("chan")  # a request in flight: the channel would stay open
        reader, writer = await asyncio.open_connection(*address)
        writer.write(frame(json.dumps({"target_group": "g0", "channel_id": "chan"}).encode()))
        outboxes.put("chan", delta("a", 1))
        ready = await read_frame(reader)  # the group took the hello
        batch = await read_frame(reader)
        writer.close()
        await until(lambda: len(outboxes) == 0)
        server.close()
        return [ready, [d.request_id for d in batch.deltas], len(outboxes)]

    assert asyncio.run(run()) == [DeltaBatch([]), ["a"], 0]


@pytest.mark.parametrize("hello", [
    b"\xff\xff\xff\xff",  # a length far past any hello
    frame(b"not json"),
    frame(json.dumps({"channel_id": "chan"}).encode()),
    frame(json.dumps({"target_group": "g1", "channel_id": "chan"}).encode()),  # another group's
    frame(json.dumps(["g0", "chan"]).encode()),
])
def test_a_connection_without_a_proper_hello_gets_nothing(hello: bytes) -> None:
    async def run() -> list:
        outboxes, server, address = await group()
        outboxes.put("chan", delta("a", 1))  # waiting for its channel: never to a stranger
        reader, writer = await asyncio.open_connection(*address)
        writer.write(hello)
        received = await asyncio.wait_for(reader.read(), 5)  # closed by the group
        writer.close()
        server.close()
        return [received, server.num_refused, len(outboxes)]

    assert asyncio.run(run()) == [b"", 1, 1]


# ---- requests sent on the channel --------------------------------------------------------------------
class Requests:
    """A group's ChannelRequests: records what came, and answers each request with one delta."""

    def __init__(self, outboxes: Outboxes, accepted: tuple[str, ...] = ()) -> None:
        self.outboxes = outboxes
        self.accepted = set(accepted)
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.lost_channels: list[str] = []

    def accepts(self, channel_id: str) -> bool:
        return channel_id in self.accepted

    def submit(self, request: GroupRequest) -> None:
        self.submitted.append(request.request_id)
        self.outboxes.put(request.channel_id, delta(request.request_id, len(request.prompt_token_ids)))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def lost(self, channel_id: str) -> None:
        self.lost_channels.append(channel_id)


class HoldHandle:
    """The groups' handle: records `hold` calls, each open until cancelled."""

    def __init__(self) -> None:
        self.hold = self
        self.holds: list[ChannelOpen] = []

    def remote(self, opened: ChannelOpen):
        self.holds.append(opened)

        async def held():
            await asyncio.Event().wait()
            yield None

        return held()


def request(request_id: str, num_prompt: int = 3) -> GroupRequest:
    return GroupRequest(request_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=4))


def sent_on_chan(request_id: str) -> bytes:
    """The frame of a request an ingress sends on channel "chan"."""
    return frame(encode_channel_message(replace(request(request_id), channel_id="chan")))


async def raw_channel(accepted: tuple[str, ...] = ("chan",), idle_s: float = 30.0):
    """A group whose requests go to a `Requests`, and a bare connection to its socket that said
    the hello of channel "chan": (outboxes, requests, server, reader, writer, first frame)."""
    outboxes = Outboxes(idle_s=idle_s)
    requests = Requests(outboxes, accepted=accepted)
    server = ChannelServer("g0", outboxes, requests)
    reader, writer = await asyncio.open_connection(*await server.start(HOST))
    writer.write(hello(ChannelOpen("g0", "chan")))
    return outboxes, requests, server, reader, writer, await read_frame(reader)


def test_requests_sent_on_the_channel_reach_the_group_and_their_deltas_come_back() -> None:
    async def run() -> list:
        outboxes = Outboxes(idle_s=30.0)
        handle = HoldHandle()
        channels = GroupChannels(handle)
        requests = Requests(outboxes, accepted=(channels.channel_id,))
        server = ChannelServer("g0", outboxes, requests)
        address = await server.start(HOST)
        first = channels.open("first")  # sent on a call: the group's Accepted opens the channel
        outboxes.begin(channels.channel_id)
        channels.accepted(first, "g0", address)
        await until(lambda: channels.sender("g0") is not None)
        streams = [channels.submit(request(r, n), "g0", channels.sender("g0")) for r, n in (("a", 5), ("b", 7))]
        got = [(await s.next()).outputs[0].token_ids for s in streams]
        sent = channels.num_sent_to("g0")
        channels.close(streams[0], abort=True)  # its client left: the group is told
        channels.close(streams[1])  # it ended: nothing to tell
        await until(lambda: requests.aborted == ["a"])
        await channels.shutdown()  # the ingress goes away: its channel's requests are lost
        await until(lambda: requests.lost_channels == [channels.channel_id])
        server.close()
        return [requests.submitted, got, sent, channels.num_sent_to("g0"), requests.aborted,
                [h.target_group for h in handle.holds], server.num_messages]

    assert asyncio.run(run()) == [["a", "b"], [[5], [7]], 2, 0, ["a"], ["g0"], 3]


def test_a_channel_that_did_not_come_through_ray_sends_nothing_the_group_reads() -> None:
    async def run() -> list:
        # The hello itself is fine (the channel may be read); the group accepts no channel's requests.
        _, requests, server, reader, writer, ready = await raw_channel(accepted=())
        writer.write(sent_on_chan("x"))
        rest = await asyncio.wait_for(reader.read(), 5)  # the group hangs up
        writer.close()
        server.close()
        return [ready, rest, requests.submitted, requests.lost_channels, server.num_messages]

    assert asyncio.run(run()) == [DeltaBatch([]), b"", [], ["chan"], 0]


@pytest.mark.parametrize("payload", [b"not a pickle", pickle.dumps({"request_id": "x"}),
                                     pickle.dumps(ChannelOpen("g0", "chan"))])
def test_a_frame_that_is_no_channel_message_ends_the_connection_and_its_requests(payload: bytes) -> None:
    async def run() -> list:
        _, requests, server, reader, writer, _ = await raw_channel()
        writer.write(sent_on_chan("a"))
        answered = await read_frame(reader)
        writer.write(frame(payload))
        rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        server.close()
        return [[d.request_id for d in answered.deltas], rest, requests.submitted, requests.lost_channels]

    assert asyncio.run(run()) == [["a"], b"", ["a"], ["chan"]]


def test_a_request_that_crosses_the_idle_close_still_runs() -> None:
    async def run() -> list:
        outboxes, requests, server, reader, writer, _ = await raw_channel(idle_s=0.05)
        closing = await read_frame(reader)  # nothing ran for idle_s: the group closes the channel ...
        # ... while the ingress sent a request, before it read the closing batch.
        writer.write(sent_on_chan("late"))
        await until(lambda: requests.submitted == ["late"])
        writer.close()  # the ingress hangs up, as it does on the closing batch
        await until(lambda: not server._writers)
        waiting = len(outboxes)  # the request's delta waits for the channel's next connection
        server.close()
        return [closing.closing, requests.submitted, requests.lost_channels, waiting]

    assert asyncio.run(run()) == [True, ["late"], [], 1]


def test_steps_the_engines_thread_writes_reach_a_slow_reader_whole_and_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's thread writes each step to the socket itself; an ingress that stops reading
    fills the socket, so frames go in part, the loop writes their ends, and later steps wait in
    the outbox: every delta arrives, in order, in frames that parse."""
    tune = channel_server.tune

    def small_buffers(sock) -> None:
        tune(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    monkeypatch.setattr(channel_server, "tune", small_buffers)
    held: list[int] = []
    write_rest = channel_server.SocketSink.write_rest

    def counted(sink) -> None:
        if sink._rest:
            held.append(len(sink._rest))
        write_rest(sink)

    monkeypatch.setattr(channel_server.SocketSink, "write_rest", counted)

    async def run() -> list:
        outboxes, server, address = await group()
        outboxes.begin("chan")
        reader, writer = await asyncio.open_connection(*address)
        # Four times what the two sockets' buffers hold, however large this kernel makes them.
        size = max(1000, writer.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 100)

        def step(n: int) -> list[GroupDelta]:
            return [GroupDelta(f"r{k}", "g0", [CompletionOutput(0, f"{n}:" + "x" * size, [n], None)], False)
                    for k in range(2)]

        writer.write(frame(json.dumps({"target_group": "g0", "channel_id": "chan"}).encode()))
        ready = await read_frame(reader)
        await until(lambda: getattr(outboxes._boxes.get("chan"), "sink", None) is not None)
        thread = threading.Thread(target=lambda: [outboxes.put_step({"chan": step(n)}) for n in range(200)])
        thread.start()
        await asyncio.sleep(0.3)  # the ingress reads nothing meanwhile: the socket fills
        got: list[tuple[str, int]] = []
        while len(got) < 400:
            batch = await asyncio.wait_for(read_frame(reader), 10)
            got.extend((d.request_id, d.outputs[0].token_ids[0]) for d in batch.deltas)
            assert all(d.outputs[0].text.startswith(f"{d.outputs[0].token_ids[0]}:") for d in batch.deltas)
        await asyncio.to_thread(thread.join)
        writer.close()
        server.close()
        return [ready, got, outboxes.num_direct > 0, outboxes.num_flushes > outboxes.num_direct]

    ready, got, direct, flushed = asyncio.run(run())
    assert ready == DeltaBatch([])
    assert got == [(f"r{k}", n) for n in range(200) for k in range(2)]
    assert direct and flushed and held
