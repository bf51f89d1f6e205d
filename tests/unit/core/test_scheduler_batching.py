"""Scheduler: chunked prefill within the token budget and the seats, preemption by recompute, finishing
and aborting (tests/unit/core/scheduler_harness.py drives it)."""

from __future__ import annotations

from tandem.workers.core.request import RequestStatus
from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, RunnerOutput
from tests.unit.core.scheduler_harness import FakeWorkers, finish_all, make_req, make_scheduler, prompt, step


# --- chunked prefill, budget and seats ----------------------------------------------------------
def test_chunked_prefill_with_decodes_first() -> None:
    s, w = make_scheduler(max_num_batched_tokens=8), FakeWorkers()
    a = make_req("a", [1, 3, 4], 0, max_tokens=4)
    b = make_req("b", prompt(20), 1, max_tokens=2)
    c = make_req("c", [5, 6], 2, max_tokens=1)
    for r in (a, b, c):
        s.add_request(r)

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}  # b's prompt is chunked; c waits
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.new_requests] == [
        ("a", [0], 0), ("b", [1, 2], 0)]
    assert (a.output_token_ids, b.output_token_ids) == ([100], [])
    assert list(s.waiting) == [c]

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # the decode first, then the chunk
    assert out.new_requests == []
    assert out.cached_requests == [CachedRequestData("a", [100], [], 3, 1), CachedRequestData("b", [], [3], 5, 2)]

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert out.cached_requests == [CachedRequestData("a", [101], [4], 4, 1),
                                   CachedRequestData("b", [], [5, 6], 12, 3)]
    assert b.num_computed_tokens == 19

    out, updates = step(s, w)
    # b's last prompt token, a's last decode, and now c fits in the budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}
    assert [n.block_ids for n in out.new_requests] == [[7]]
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("a", [103]), ("b", [100]), ("c", [100])]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [100, 101, 102, 103]
    assert c.status == RequestStatus.FINISHED_LENGTH

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.finished_req_ids == {"a", "c"}
    # a's blocks went back tail first ([4, 0]), then c's ([7]); b takes block 8.
    assert out.cached_requests == [CachedRequestData("b", [100], [8], 20, 5)]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert s.num_unfinished == 0
    s.kv.pool.check_all_free()


def test_total_tokens_never_exceed_the_budget() -> None:
    s, w = make_scheduler(max_num_batched_tokens=6), FakeWorkers()
    for i in range(3):
        s.add_request(make_req(f"r{i}", prompt(9, 20 * i), i, max_tokens=3))
    totals = []
    while s.num_unfinished:
        out, _ = step(s, w)
        totals.append(out.total_num_scheduled_tokens)
    assert totals == [6, 6, 6, 6, 6, 2, 1]
    s.kv.pool.check_all_free()


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    s, w = make_scheduler(max_num_batched_tokens=8, chunked=False), FakeWorkers()
    s.add_request(make_req("a", [1, 3, 4], 0, max_tokens=3))
    s.add_request(make_req("b", prompt(6), 1, max_tokens=1))
    s.add_request(make_req("c", [7], 2, max_tokens=1))

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 3}  # b (6 > 5 left) is not split; c queues behind it
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6, "c": 1}
    finish_all(s)


def test_max_num_seqs() -> None:
    s, w = make_scheduler(max_num_seqs=2), FakeWorkers()
    s.add_request(make_req("a", [1, 3], 0, max_tokens=1))
    s.add_request(make_req("b", [4, 5], 1, max_tokens=3))
    s.add_request(make_req("c", [6, 7], 2, max_tokens=3))
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 2, "b": 2}
    assert [r.request_id for r in s.waiting] == ["c"]
    out, _ = step(s, w)  # a finished last step: its seat goes to c
    assert out.num_scheduled_tokens == {"b": 1, "c": 2}
    assert out.finished_req_ids == {"a"}
    finish_all(s)


def test_step_diffs_carry_only_new_blocks_and_tokens() -> None:
    s, w = make_scheduler(), FakeWorkers()
    s.add_request(make_req("a", prompt(5), 0))
    out, _ = step(s, w)
    assert out.new_requests == [NewRequestData("a", prompt(5), [], s.requests["a"].sampling_params, [0, 1], 0)]
    assert out.cached_requests == []
    diffs = []
    for _ in range(4):
        out, _ = step(s, w)
        assert out.new_requests == []
        diffs += out.cached_requests
    assert diffs == [
        CachedRequestData("a", [100], [], 5, 2),
        CachedRequestData("a", [101], [], 6, 2),
        CachedRequestData("a", [102], [], 7, 2),
        CachedRequestData("a", [103], [2], 8, 2),  # position 8 opens block 2
    ]
    finish_all(s)


def test_empty_schedule() -> None:
    s = make_scheduler()
    out = s.schedule()
    assert out.is_empty and out.step_id == 0
    assert s.schedule().step_id == 1


# --- preemption -------------------------------------------------------------------------------
def test_preemption_by_recompute_picks_the_latest_arrival() -> None:
    s, w = make_scheduler(num_blocks=5), FakeWorkers()
    a = make_req("a", prompt(4), 0, max_tokens=6)
    b = make_req("b", prompt(4, 50), 1, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s, w)
    assert [n.block_ids for n in out.new_requests] == [[0], [1]]
    out, _ = step(s, w)
    assert [d.new_block_ids for d in out.cached_requests] == [[2], [3]]
    for _ in range(3):
        out, _ = step(s, w)
        assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])

    # Both need a third block; one is left. a takes it, b (the latest arrival) is preempted.
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_requests == [CachedRequestData("a", [104], [4], 8, 2)]
    assert out.finished_req_ids == {"b"}  # workers drop b's stale state
    assert b.status == RequestStatus.PREEMPTED
    assert (b.block_ids, b.num_computed_tokens, b.num_preemptions) == ([], 0, 1)
    assert b.output_token_ids == [100, 101, 102, 103, 104]  # kept for the recompute
    assert s.num_preemptions == 1
    assert a.status == RequestStatus.FINISHED_LENGTH  # its 6th token
    assert list(s.waiting) == [b] and s.running == []

    # b resumes in full: prompt + outputs so far, recomputed from scratch.
    out, updates = step(s, w)
    assert out.new_requests == [NewRequestData("b", prompt(4, 50), [100, 101, 102, 103, 104],
                                               b.sampling_params, [3, 1, 4], 0)]
    assert out.num_scheduled_tokens == {"b": 9}
    assert out.finished_req_ids == {"a"}
    assert [u.new_token_ids for u in updates] == [[105]]
    assert b.output_token_ids == [100, 101, 102, 103, 104, 105]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert s.stats()["num_preemptions"] == 1
    s.kv.pool.check_all_free()


def test_preempted_request_is_not_admitted_in_the_same_step() -> None:
    s, w = make_scheduler(num_blocks=2), FakeWorkers()
    a = make_req("a", prompt(4), 0)
    s.add_request(a)
    b = make_req("b", prompt(3, 50), 1)
    s.add_request(b)
    step(s, w)
    step(s, w)  # a: [0, 1]; b: waits for a block
    assert (a.block_ids, [r.request_id for r in s.waiting]) == ([0, 1], ["b"])
    finish_all(s)


def test_preempting_a_request_already_scheduled_this_step() -> None:
    # Decodes are scheduled before prefill chunks, so the latest arrival can already
    # be in this step when an earlier arrival's chunk runs out of blocks (e.g. an n > 1
    # sibling admitted after a later request). It must be taken back out of the step.
    s, w = make_scheduler(num_blocks=3, max_num_batched_tokens=8), FakeWorkers()
    late = make_req("late", [1, 3], 5, max_tokens=3)
    early = make_req("early", prompt(11), 1, max_tokens=2)
    s.add_request(late)
    step(s, w)
    s.add_request(early)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"late": 1, "early": 7}
    assert (late.block_ids, early.block_ids) == ([0], [1, 2])

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"early": 4}
    assert out.new_requests == []
    assert out.cached_requests == [CachedRequestData("early", [], [0], 7, 2)]
    assert out.finished_req_ids == {"late"}
    assert late.status == RequestStatus.PREEMPTED
    assert (late.num_computed_tokens, late.block_ids, late.output_token_ids) == (0, [], [100, 101])
    assert early.output_token_ids == [100]

    out, _ = step(s, w)  # early's last token; late still does not fit
    assert out.num_scheduled_tokens == {"early": 1}
    assert early.status == RequestStatus.FINISHED_LENGTH
    out, _ = step(s, w)
    assert out.new_requests == [NewRequestData("late", [1, 3], [100, 101], late.sampling_params, [0], 0)]
    assert out.num_scheduled_tokens == {"late": 4}
    assert late.output_token_ids == [100, 101, 102]
    assert late.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    s, w = make_scheduler(num_blocks=4, prefix=True), FakeWorkers()
    a = make_req("a", prompt(8), 0, max_tokens=2)
    b = make_req("b", prompt(4, 50), 1, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 8, "b": 4}
    assert (a.block_ids, b.block_ids) == ([0, 1], [2])
    assert s.kv.pool.num_cached_blocks == 3  # a's two prompt blocks and b's one

    out, _ = step(s, w)  # a takes the last block for its decode; b is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == {"b"}
    assert out.cached_requests == [CachedRequestData("a", [100], [3], 8, 2)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert b.status == RequestStatus.PREEMPTED

    # b's freed block 2 is still cached: only its last token is recomputed.
    out, _ = step(s, w)
    assert out.new_requests == [NewRequestData("b", prompt(4, 50), [100], b.sampling_params, [2, 3], 4)]
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.finished_req_ids == {"a"}
    assert b.num_cached_prompt_tokens == 0  # set at the first admission only
    assert b.output_token_ids == [100, 101]
    finish_all(s)


# --- finishing and aborting -------------------------------------------------------------------
def test_abort_frees_blocks_at_once_in_any_state() -> None:
    s, w = make_scheduler(num_blocks=8, max_num_batched_tokens=8), FakeWorkers()
    running = make_req("running", prompt(10), 0)
    waiting = make_req("waiting", prompt(3), 1)
    s.add_request(running)
    s.add_request(waiting)
    step(s, w)  # running: a chunk of 8 tokens in blocks [0, 1]; waiting stays waiting
    assert running.block_ids == [0, 1] and running.is_prefill
    assert s.kv.pool.num_free_blocks == 6

    aborted = s.finish_request("running", RequestStatus.FINISHED_ABORTED)
    assert aborted is running
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert (running.block_ids, s.kv.pool.num_free_blocks) == ([], 8)
    assert s.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is waiting
    assert s.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is None
    assert s.finish_request("unknown", RequestStatus.FINISHED_ABORTED) is None
    out = s.schedule()
    assert out.is_empty
    assert out.finished_req_ids == {"running"}  # "waiting" never reached the workers
    assert s.schedule().finished_req_ids == set()
    s.kv.pool.check_all_free()


def test_abort_a_preempted_request() -> None:
    s, w = make_scheduler(num_blocks=2), FakeWorkers()
    a = make_req("a", prompt(4), 0)
    b = make_req("b", prompt(4, 50), 1)
    s.add_request(a)
    s.add_request(b)
    step(s, w)
    step(s, w)  # a takes the last block; b is preempted
    assert b.status == RequestStatus.PREEMPTED
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert list(s.waiting) == []
    assert s.kv.pool.num_free_blocks == 0
    finish_all(s)


def test_abort_while_the_step_runs() -> None:
    s, w = make_scheduler(), FakeWorkers()
    s.add_request(make_req("a", prompt(3), 0))
    out = s.schedule()
    w.apply(out)
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.update(out, RunnerOutput(["a"], [[7]], [None])) == []
    s.kv.pool.check_all_free()
