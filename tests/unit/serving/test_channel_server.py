"""A group's channel socket and an ingress reading it, over real TCP on loopback: each
stream gets its own deltas in order across frames, an idle channel closes and reopens,
a group that goes away ends exactly its streams, the ingress hanging up ends the group's
writing at once, and a connection that does not say a proper hello gets nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.router.group_channels import ChannelLost, GroupChannels
from tandem.workers.serving.channel_server import ChannelServer, frame
from tandem.workers.serving.messages import DeltaBatch, GroupDelta, decode_batch, encode_batch
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
        header = await reader.readexactly(4)
        batch = decode_batch(await reader.readexactly(int.from_bytes(header, "big")))
        writer.close()
        await until(lambda: len(outboxes) == 0)
        server.close()
        return [[d.request_id for d in batch.deltas], len(outboxes)]

    assert asyncio.run(run()) == [["a"], 0]


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
