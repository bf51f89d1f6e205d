"""An ingress's channels: one channel per group carries many streams, each stream gets its own
deltas in order (joined when several wait), and a channel that ends or fails ends exactly
the streams of its group."""

from __future__ import annotations

import asyncio

import pytest

from tandem.router.group_channels import ChannelLost, GroupChannels
from tandem.workers.core.request import CompletionOutput, Logprob
from tandem.workers.serving.messages import ChannelOpen, DeltaBatch, GroupDelta


def delta(request_id: str, token: int, *, group: str = "g0", index: int = 0, finish: str | None = None,
          logprobs: bool = False) -> GroupDelta:
    lp = [{token: Logprob(-0.25, 1, f"t{token}")}] if logprobs else None
    return GroupDelta(request_id, group, [CompletionOutput(index, f"t{token}", [token], lp, finish)],
                      finish is not None)


class FakeHandle:
    """The groups' streaming handle: `channel.remote` gives a channel this test feeds."""

    def __init__(self) -> None:
        self.channel = self
        self.opened: list[ChannelOpen] = []
        self.feeds: dict[str, asyncio.Queue] = {}

    def remote(self, opened: ChannelOpen):
        self.opened.append(opened)
        feed = self.feeds.setdefault(opened.target_group, asyncio.Queue())

        async def batches():
            while True:
                item = await feed.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item

        return batches()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def accepted(*request_ids: str, group: str = "g0") -> tuple[FakeHandle, GroupChannels, list]:
    """Streams for `request_ids` that `group` accepted, its channel opened and waiting."""
    handle = FakeHandle()
    channels = GroupChannels(handle)
    streams = [channels.open(r) for r in request_ids]
    for s in streams:
        channels.accepted(s, group)
    await settle()
    return handle, channels, streams


def test_one_channel_per_group_carries_every_stream_and_hands_each_its_own() -> None:
    async def run() -> list:
        handle, channels, streams = await accepted("r0", "r1", "r2")
        handle.feeds["g0"].put_nowait(DeltaBatch([delta("r0", 1), delta("r2", 5), delta("gone", 9), delta("r1", 3)]))
        await settle()
        firsts = [(await s.next()).outputs[0].token_ids for s in streams]
        return [len(handle.opened), handle.opened[0].channel_id == channels.channel_id, firsts,
                channels.num_batches, channels.num_deltas]

    assert asyncio.run(run()) == [1, True, [[1], [3], [5]], 1, 4]


def test_deltas_waiting_for_a_stream_come_joined_and_the_finish_stays_last() -> None:
    async def run() -> list:
        handle, channels, [stream] = await accepted("r")
        handle.feeds["g0"].put_nowait(DeltaBatch([delta("r", 1, logprobs=True), delta("r", 2, index=1)]))
        handle.feeds["g0"].put_nowait(DeltaBatch([delta("r", 3, logprobs=True), delta("r", 4, finish="length")]))
        handle.feeds["g0"].put_nowait(DeltaBatch([delta("r", 9)]))  # after the finish: never joined to it
        await settle()
        first = await stream.next()  # alone, however many came with it (time to first token)
        joined = await stream.next()
        return [first.outputs[0].token_ids,
                [(o.index, o.text, o.token_ids, o.finish_reason, o.logprobs is not None) for o in joined.outputs],
                joined.finished]

    assert asyncio.run(run()) == [[1], [(0, "t3t4", [3, 4], "length", True), (1, "t2", [2], None, False)], True]


def test_deltas_that_came_before_the_first_read_go_first_alone_then_all_joined() -> None:
    from tandem.router.group_channels import ChannelStream

    async def run() -> list:
        stream = ChannelStream("r")
        for token in range(1, 5):
            stream.put(delta("r", token))
        unread = stream.num_unread
        first, rest = await stream.next(), await stream.next()
        return [unread, first.outputs[0].token_ids, rest.outputs[0].text, rest.outputs[0].token_ids, stream.num_unread]

    assert asyncio.run(run()) == [4, [1], "t2t3t4", [2, 3, 4], 0]


def test_an_error_after_waiting_deltas_comes_after_them() -> None:
    from tandem.router.group_channels import ChannelStream

    async def run() -> list:
        stream = ChannelStream("r")
        stream.put(delta("r", 1))
        got = [(await stream.next()).outputs[0].token_ids]
        stream.put(delta("r", 2))
        stream.put(delta("r", 3))
        stream.put(ChannelLost("its channel ended", "g0"))
        stream.put(delta("r", 4))  # (after the error: never joined to what came before it)
        got.append((await stream.next()).outputs[0].token_ids)
        with pytest.raises(ChannelLost, match="its channel ended"):
            await stream.next()
        got.append((await stream.next()).outputs[0].token_ids)
        return got

    assert asyncio.run(run()) == [[1], [2, 3], [4]]


def test_a_reader_waiting_for_its_next_delta_wakes_when_it_comes() -> None:
    from tandem.router.group_channels import ChannelStream

    async def run() -> list:
        stream = ChannelStream("r")
        stream.put(delta("r", 1))
        await stream.next()
        reader = asyncio.get_running_loop().create_task(stream.next())
        await settle()
        waiting = not reader.done()
        stream.put(delta("r", 2, finish="stop"))
        joined = await reader
        return [waiting, joined.outputs[0].token_ids, joined.finished]

    assert asyncio.run(run()) == [True, [2], True]


def test_a_lost_channel_ends_the_streams_of_its_group_only() -> None:
    async def run() -> list:
        handle = FakeHandle()
        channels = GroupChannels(handle)
        a, b, c = channels.open("a"), channels.open("b"), channels.open("c")
        channels.accepted(a, "g0")
        channels.accepted(b, "g0")
        channels.accepted(c, "g1")
        await settle()
        handle.feeds["g0"].put_nowait(RuntimeError("the replica died"))
        handle.feeds["g1"].put_nowait(DeltaBatch([delta("c", 7, group="g1")]))
        await settle()
        lost = []
        for s in (a, b):
            with pytest.raises(ChannelLost) as info:
                await s.next()
            lost.append((info.value.group_id, str(info.value)))
        got = (await c.next()).outputs[0].token_ids
        # The next request g0 takes opens a new channel.
        d = channels.open("d")
        channels.accepted(d, "g0")
        await settle()
        return [lost, got, [o.target_group for o in handle.opened]]

    assert asyncio.run(run()) == [[("g0", "its channel failed: RuntimeError")] * 2, [7], ["g0", "g1", "g0"]]


def test_a_channel_that_ends_ends_its_streams() -> None:
    async def run() -> str:
        handle, channels, [stream] = await accepted("a")
        handle.feeds["g0"].put_nowait(None)  # routed to a group that is gone: it ends at once
        await settle()
        with pytest.raises(ChannelLost) as info:
            await stream.next()
        return str(info.value)

    assert asyncio.run(run()) == "its channel ended"


def test_a_request_id_in_flight_is_refused_and_free_again_once_closed() -> None:
    async def run() -> None:
        channels = GroupChannels(FakeHandle())
        stream = channels.open("r")
        with pytest.raises(ValueError, match="^request_id: 'r' is already in flight$"):
            channels.open("r")
        channels.close(stream)
        channels.open("r")

    asyncio.run(run())


def test_a_delta_of_another_group_does_not_reach_a_retried_request() -> None:
    async def run() -> list:
        handle, channels, [stream] = await accepted("r", group="g1")  # the retry's group; g0 failed it
        handle.feeds["g1"].put_nowait(DeltaBatch([delta("r", 1, group="g0"), delta("r", 2, group="g1")]))
        await settle()
        return (await stream.next()).outputs[0].token_ids

    assert asyncio.run(run()) == [2]


def test_a_channel_closed_for_being_idle_reopens_while_a_stream_needs_it() -> None:
    async def run() -> list:
        handle, channels, [stream] = await accepted("r")
        # The group closed it idle just as it took this request: the ingress opens it again.
        handle.feeds["g0"].put_nowait(DeltaBatch([], closing=True))
        await settle()
        handle.feeds["g0"].put_nowait(DeltaBatch([delta("r", 4, finish="length")]))
        await settle()
        got = (await stream.next()).outputs[0].token_ids
        channels.close(stream)
        handle.feeds["g0"].put_nowait(DeltaBatch([], closing=True))  # idle, nobody waits: it stays closed
        await settle()
        return [got, len(handle.opened), channels._pumps]

    assert asyncio.run(run()) == [[4], 2, {}]


def test_a_client_that_does_not_read_ends_its_request_and_frees_what_it_held() -> None:
    """Its reader is stuck writing to the client: past MAX_UNREAD deltas the stream drops them
    and cancels the reader, whose clean-up cancels the group call (the group frees the KV)."""
    from tandem.router.group_channels import ChannelStream, SlowReader

    async def run() -> tuple:
        stream = ChannelStream("r1", max_unread=3)
        stuck = asyncio.Event()

        async def reader() -> None:  # one delta, then a client write that never returns
            await stream.next()
            await stuck.wait()

        task = asyncio.get_running_loop().create_task(reader())
        stream.put(delta("r1", 1))
        await settle()
        for token in range(2, 6):  # 3 unread fit; the 4th is one too many
            stream.put(delta("r1", token))
        await settle()
        stream.put(delta("r1", 9))  # after the end: dropped
        with pytest.raises(SlowReader, match="the client left more than 3 deltas unread"):
            await stream.next()
        return task.cancelled(), stream.overflowed, stream.num_unread, len(stream._waiting)

    assert asyncio.run(run()) == (True, True, 0, 0)


def test_a_reader_that_keeps_up_is_never_ended() -> None:
    from tandem.router.group_channels import ChannelStream

    async def run() -> list[int]:
        stream = ChannelStream("r1", max_unread=3)
        tokens = []
        for token in range(20):
            stream.put(delta("r1", token, finish="length" if token == 19 else None))
            tokens += (await stream.next()).outputs[0].token_ids
        return tokens

    assert asyncio.run(run()) == list(range(20))


def test_each_request_names_its_groups_share_of_the_ingress_budget() -> None:
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.serving.messages import GroupRequest

    groups = [1]
    channels = GroupChannels(FakeHandle(), max_chunks_per_s=2000.0, num_groups=lambda: groups[0])
    request = GroupRequest("r", [1, 2], SamplingParams())
    sent = channels.with_channel(request)
    assert (sent.channel_id, sent.chunks_per_s) == (channels.channel_id, 2000.0)
    groups[0] = 4  # the router knows four groups now: each paces its streams to a quarter
    assert channels.with_channel(request).chunks_per_s == 500.0
    groups[0] = 0  # before the router's first word: all of it
    assert channels.with_channel(request).chunks_per_s == 2000.0
    assert GroupChannels(FakeHandle()).with_channel(request).chunks_per_s == 0.0  # no bound
