"""A group's outboxes: what waits for a channel goes out in one batch per flush, in order,
and a reopened channel takes over what its old call had not sent; a step the engine's thread
puts goes straight to the channel's connection while nothing waits, and in order whichever
thread puts what."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from tandem.workers.core.request import CompletionOutput
from tandem.workers.serving.messages import DeltaBatch, GroupDelta
from tandem.workers.serving.outbox import Outboxes


def delta(request_id: str, token: int) -> GroupDelta:
    return GroupDelta(request_id, "g0", [CompletionOutput(0, f"t{token}", [token], None)], False)


def ids(batch) -> list[tuple[str, int]]:
    return [(d.request_id, d.outputs[0].token_ids[0]) for d in batch.deltas]


def test_deltas_put_before_the_channel_opens_go_out_in_its_first_flush() -> None:
    async def run() -> list:
        boxes = Outboxes()
        boxes.put("c1", delta("a", 1))
        boxes.put("c1", delta("b", 2))
        flushes = boxes.flushes("c1")
        first = await anext(flushes)
        boxes.put("c1", delta("a", 3))
        second = await anext(flushes)
        await flushes.aclose()
        return [ids(first), ids(second), len(boxes), boxes.num_flushes, boxes.num_deltas]

    assert asyncio.run(run()) == [[("a", 1), ("b", 2)], [("a", 3)], 0, 2, 3]


def test_what_one_event_loop_turn_puts_is_one_flush() -> None:
    async def run() -> list:
        boxes = Outboxes()
        flushes = boxes.flushes("c1")
        waiting = asyncio.ensure_future(anext(flushes))
        await asyncio.sleep(0)  # the channel waits for news
        for i in range(64):  # a step's outputs, handed to the loop together
            boxes.put("c1", delta(f"r{i}", i))
        batch = await waiting
        await flushes.aclose()
        return [len(batch.deltas), boxes.num_flushes]

    assert asyncio.run(run()) == [64, 1]


def test_channels_do_not_see_each_others_deltas() -> None:
    async def run() -> list:
        boxes = Outboxes()
        boxes.put("c1", delta("a", 1))
        boxes.put("c2", delta("b", 2))
        one, two = boxes.flushes("c1"), boxes.flushes("c2")
        got = [ids(await anext(one)), ids(await anext(two))]
        await one.aclose()
        await two.aclose()
        return got

    assert asyncio.run(run()) == [[("a", 1)], [("b", 2)]]


def test_a_reopened_channel_takes_over_and_the_old_call_ends() -> None:
    async def run() -> list:
        boxes = Outboxes()
        old = boxes.flushes("c1")
        old_waiting = asyncio.ensure_future(anext(old))
        await asyncio.sleep(0)
        new = boxes.flushes("c1")
        new_waiting = asyncio.ensure_future(anext(new))
        await asyncio.sleep(0)
        boxes.put("c1", delta("a", 1))
        got = ids(await new_waiting)
        try:
            await old_waiting
            old_ended = False
        except StopAsyncIteration:
            old_ended = True
        await new.aclose()
        return [got, old_ended, len(boxes)]

    assert asyncio.run(run()) == [[("a", 1)], True, 0]


def test_a_channel_with_no_request_closes_itself_after_idle_s() -> None:
    async def run() -> list:
        boxes = Outboxes(idle_s=0.01)
        boxes.begin("c1")
        flushes = boxes.flushes("c1")
        boxes.put("c1", delta("a", 1))
        first = await anext(flushes)
        waiting = asyncio.ensure_future(anext(flushes))
        await asyncio.sleep(0.05)  # idle, but a request is running: the channel stays
        still_open = not waiting.done()
        boxes.end("c1")
        last = await waiting
        try:
            await anext(flushes)
            ended = False
        except StopAsyncIteration:
            ended = True
        return [ids(first), still_open, last.deltas, last.closing, ended, len(boxes)]

    assert asyncio.run(run()) == [[("a", 1)], True, [], True, True, 0]


class RecordingSink:
    """A connection as the engine's thread sees it: frames land in `wire` in the order a socket
    would carry them. `partial(i)`: whether the socket takes only the first half of frame i (the
    loop writes the rest, as SocketSink does)."""

    def __init__(self, boxes: Outboxes, partial=lambda i: False) -> None:
        self.busy = 0
        self.wire: list[tuple[int, str, list]] = []  # (frame, "whole" | "head" | "tail", deltas)
        self.threads: set[str] = set()
        self._boxes, self._partial, self._rest = boxes, partial, None
        self._frames = 0
        self._loop = asyncio.get_running_loop()

    def ready(self) -> bool:
        return True

    def send(self, batch) -> None:
        self.threads.add(threading.current_thread().name)
        i, self._frames = self._frames, self._frames + 1
        if not self._partial(i):
            self.wire.append((i, "whole", ids(batch)))
            return
        self.wire.append((i, "head", []))
        self._rest = (i, ids(batch))
        self.busy += 1
        self._loop.call_soon_threadsafe(self.write_rest)

    def write_rest(self) -> None:
        with self._boxes.lock:
            if self._rest is not None:
                i, deltas = self._rest
                self.wire.append((i, "tail", deltas))
                self._rest = None
                self.busy -= 1

    def write(self, batch) -> None:
        """The loop's write of a flush (ChannelServer._write_all)."""
        self.write_rest()
        self.wire.append((-1, "whole", ids(batch)))


def test_a_step_goes_out_from_the_engines_thread_while_nothing_waits() -> None:
    async def run() -> list:
        boxes = Outboxes()
        sink = RecordingSink(boxes)
        flushes = boxes.flushes("c1", sink)
        waiting = asyncio.ensure_future(anext(flushes))
        await asyncio.sleep(0)
        await asyncio.to_thread(boxes.put_step, {"c1": [delta("a", 1), delta("b", 2)]})
        await asyncio.sleep(0.01)
        off_the_loop = sink.threads - {"MainThread"} == sink.threads != set()
        direct = [list(sink.wire), waiting.done(), boxes.num_direct, off_the_loop]
        # Something put on the loop first: the step waits behind it, in the next flush.
        boxes.put("c1", delta("a", 3))
        boxes.put_step({"c1": [delta("b", 4)]})
        sink.write(await waiting)
        waiting.cancel()
        await flushes.aclose()
        return [*direct, sink.wire[1:], boxes.num_flushes, boxes.num_deltas]

    assert asyncio.run(run()) == [[(0, "whole", [("a", 1), ("b", 2)])], False, 1, True,
                                  [(-1, "whole", [("a", 3), ("b", 4)])], 2, 4]


def test_a_channel_without_a_connection_keeps_the_step_for_its_first_flush() -> None:
    async def run() -> list:
        boxes = Outboxes()
        await asyncio.to_thread(boxes.put_step, {"c1": [delta("a", 1)], "c2": [delta("b", 2)]})
        one, two = boxes.flushes("c1"), boxes.flushes("c2")
        got = [ids(await anext(one)), ids(await anext(two)), boxes.num_direct]
        waiting = asyncio.ensure_future(anext(one))
        await asyncio.sleep(0)
        await asyncio.to_thread(boxes.put_step, {"c1": [delta("a", 5)]})  # wakes the flush
        got.append(ids(await asyncio.wait_for(waiting, 5)))
        await one.aclose()
        await two.aclose()
        return got

    assert asyncio.run(run()) == [[("a", 1)], [("b", 2)], 0, [("a", 5)]]


@pytest.mark.parametrize("seed", range(4))
def test_from_both_threads_a_channels_deltas_reach_the_wire_in_order(seed: int) -> None:
    """An engine thread puts 400 steps while the loop puts deltas of its own (errors, the
    first deltas of a request) and flushes what waits; the socket takes some frames only in
    part. On the wire every delta is where it was put, and no frame is split by another."""

    async def run() -> tuple[list, list, int]:
        boxes = Outboxes()
        rng = random.Random(seed)
        sink = RecordingSink(boxes, partial=lambda i: rng.random() < 0.3)
        put: list[tuple[str, int]] = []  # the order of putting, from either thread
        order = threading.Lock()
        done = threading.Event()

        def engine() -> None:
            for step in range(400):
                news = [delta(f"e{step}", k) for k in range(rng.randrange(1, 4))]
                with order:
                    put.extend(ids(DeltaBatch(news)))
                    boxes.put_step({"c1": news})
                if step % 7 == 0:
                    time.sleep(0.0005)
            done.set()

        async def write_flushes() -> None:
            async for batch in boxes.flushes("c1", sink):
                sink.write(batch)
                await asyncio.sleep(0)

        writer = asyncio.ensure_future(write_flushes())
        await asyncio.sleep(0)
        thread = threading.Thread(target=engine)
        thread.start()
        n = 0
        while not done.is_set():
            with order:
                boxes.put("c1", delta("loop", n))
                put.append(("loop", n))
            n += 1
            await asyncio.sleep(0.001)
        await asyncio.to_thread(thread.join)
        deadline = time.monotonic() + 30
        while sum(len(deltas) for _, _, deltas in sink.wire) < len(put) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # the loop flushes what waits
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        return put, sink.wire, boxes.num_direct

    put, wire, num_direct = asyncio.run(run())
    assert [d for _, _, deltas in wire for d in deltas] == put
    for k, (frame, part, _) in enumerate(wire):
        if part == "head":  # its tail comes next, before anything else
            assert wire[k + 1][:2] == (frame, "tail")
    assert num_direct > 0 and any(part == "head" for _, part, _ in wire)


def test_a_channels_streams_share_its_budget_and_the_groups_floor() -> None:
    boxes = Outboxes(min_interval_s=0.010)
    pace = boxes.begin("c1", chunks_per_s=2000.0)
    assert pace.interval_s == 0.010  # one stream: 0.5 ms of the budget, but the floor is 10 ms
    for _ in range(99):
        assert boxes.begin("c1", chunks_per_s=2000.0) is pace  # one pace for the channel's streams
    assert pace.interval_s == 100 / 2000
    other = boxes.begin("c2")  # no budget: no bound but the floor
    assert other is not pace and other.interval_s == 0.010
    assert boxes.begin("c1", chunks_per_s=1000.0).interval_s == 101 / 1000  # the ingress's latest word
    for _ in range(51):
        boxes.end("c1")
    assert pace.interval_s == 50 / 1000
    for _ in range(50):
        boxes.end("c1")
    assert boxes.begin("c1").interval_s == 0.010  # every stream ended: a fresh pace, no budget said


def test_without_a_budget_or_floor_every_step_goes_out() -> None:
    boxes = Outboxes()
    assert boxes.begin("c1").interval_s == 0.0
    assert boxes.begin("c1", chunks_per_s=0.0).interval_s == 0.0
