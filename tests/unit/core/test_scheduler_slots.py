"""Scheduler: pipeline slots (steps of different requests in flight at once, one a slot):
a slot schedules only its own requests, new ones join the slot being scheduled up to its share,
preemption never takes another slot's request, and a request is never in two steps at once."""

from __future__ import annotations

from tandem.workers.core.request import RequestStatus
from tandem.workers.core.scheduler_output import RunnerOutput, SchedulerOutput
from tests.unit.core.scheduler_harness import finish_all, make_req, make_scheduler, prompt


def _sample(out: SchedulerOutput, token: int = 50) -> RunnerOutput:
    """Every scheduled request samples `token` (the tests' prompts fit in one step)."""
    req_ids = list(out.num_scheduled_tokens)
    return RunnerOutput(req_ids, [[token] for _ in req_ids], [None] * len(req_ids))


def test_new_requests_split_over_the_slots_and_each_slot_schedules_its_own() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=8)
    for i in range(6):
        s.add_request(make_req(f"r{i}", prompt(3, 10 * i), i))
    first = s.schedule(slot=0, num_slots=2)  # six waiting: this slot takes its half
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r2"]
    second = s.schedule(slot=1, num_slots=2)  # launched while the first is in flight
    assert list(second.num_scheduled_tokens) == ["r3", "r4", "r5"]
    assert [r.pp_slot for r in s.running] == [0, 0, 0, 1, 1, 1]
    s.update(first, _sample(first))
    again = s.schedule(slot=0, num_slots=2)  # slot 1's requests are still in flight: left alone
    assert list(again.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert all(n == 1 for n in again.num_scheduled_tokens.values())
    s.update(second, _sample(second))
    s.update(again, _sample(again, 51))
    assert s.requests["r0"].output_token_ids == [50, 51] and s.requests["r3"].output_token_ids == [50]
    finish_all(s)


def test_a_slot_takes_no_more_than_its_share_of_the_seats() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=4)
    for i in range(8):
        s.add_request(make_req(f"r{i}", prompt(2, 10 * i), i))
    out = s.schedule(slot=0, num_slots=2)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]  # 4 seats, 2 slots
    out = s.schedule(slot=1, num_slots=2)
    assert list(out.num_scheduled_tokens) == ["r2", "r3"]
    assert len(s.waiting) == 4
    finish_all(s)


def test_a_lone_request_is_not_held_back_by_the_other_slot() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=8)
    s.add_request(make_req("a", prompt(3), 0))
    out = s.schedule(slot=1, num_slots=2)  # one request: its slot's share is one seat
    assert list(out.num_scheduled_tokens) == ["a"] and s.requests["a"].pp_slot == 1
    assert not s.schedule(slot=0, num_slots=2).num_scheduled_tokens
    finish_all(s)


def test_preemption_takes_its_victims_from_the_slot_being_scheduled() -> None:
    # 7 blocks of 4 tokens. Slot 0 holds "old" (in flight); slot 1's "b" and "c" fill the rest.
    s = make_scheduler(num_blocks=7, max_num_seqs=4)
    s.add_request(make_req("old", prompt(8), 0))
    s.add_request(make_req("b", prompt(8, 30), 1))
    s.add_request(make_req("c", prompt(7, 60), 2))
    slot0 = s.schedule(slot=0, num_slots=2)
    assert list(slot0.num_scheduled_tokens) == ["old", "b"]
    s.update(slot0, _sample(slot0))
    slot1 = s.schedule(slot=1, num_slots=2)
    assert list(slot1.num_scheduled_tokens) == ["c"]
    s.update(slot1, _sample(slot1))
    # Slot 0 runs again as if slot 1's "c" were in flight: "old" and "b" each need a third
    # block and one is free, so slot 0 preempts its own latest ("b"), never "c" (the latest of all).
    slot0 = s.schedule(slot=0, num_slots=2)
    assert s.requests["c"].status == RequestStatus.RUNNING
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert list(slot0.num_scheduled_tokens) == ["old"]
    finish_all(s)
