"""A group's outboxes: what waits for a channel goes out in one batch per flush, in order,
and a reopened channel takes over what its old call had not sent."""

from __future__ import annotations

import asyncio

from tandem.workers.core.request import CompletionOutput
from tandem.workers.serving.messages import GroupDelta
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
