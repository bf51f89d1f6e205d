"""Scheduler: prefix-cache hits at admission, `n > 1` siblings sharing their leader's prompt blocks,
its stats."""

from __future__ import annotations

from tandem.workers.core.request import RequestStatus
from tandem.workers.core.scheduler_output import NewRequestData
from tests.unit.core.scheduler_harness import FakeWorkers, finish_all, make_req, make_scheduler, prompt, step


# --- prefix caching and n > 1 ---------------------------------------------------------------
def test_prefix_cache_hit_at_admission() -> None:
    s, w = make_scheduler(prefix=True), FakeWorkers()
    first = make_req("first", prompt(10), 0, max_tokens=1)
    s.add_request(first)
    step(s, w)
    assert first.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_cached_blocks == 2

    again = make_req("again", prompt(10), 1, max_tokens=1)
    s.add_request(again)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"again": 2}  # 8 of 10 prompt tokens were cached
    assert out.new_requests == [NewRequestData("again", prompt(10), [], again.sampling_params, [0, 1, 3], 8)]
    assert again.num_cached_prompt_tokens == 8

    # A prompt that is exactly the cached blocks still computes its last block.
    short = make_req("short", prompt(8), 2, max_tokens=1)
    s.add_request(short)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"short": 4}
    assert short.num_cached_prompt_tokens == 4
    assert out.new_requests[0].block_ids == [0, 4]  # again's blocks went back [3, 1, 0]
    s.kv.pool.check_all_free()


def test_blocks_filled_by_decoding_are_published_at_the_step_that_fills_them() -> None:
    """A decoded block is published once its last token's KV is computed, and a later prompt that
    repeats the prompt and the output so far finds every such block."""
    s, w = make_scheduler(prefix=True), FakeWorkers()
    first = make_req("first", prompt(6), 0, max_tokens=9)
    s.add_request(first)
    published = []
    while not first.status.is_finished:
        step(s, w)
        published.append((first.num_computed_tokens, first.num_published_blocks, s.kv.pool.num_cached_blocks))
    # KV computed for 6 prompt tokens, then one more a step; a block of 4 is published when full.
    # The last step finishes the request: its blocks go back (still cached), its count to 0.
    assert published == [(6, 1, 1), (7, 1, 1), (8, 2, 2), (9, 2, 2), (10, 2, 2), (11, 2, 2), (12, 3, 3),
                         (13, 3, 3), (14, 0, 3)]
    assert first.status == RequestStatus.FINISHED_LENGTH
    again = make_req("again", first.all_token_ids, 1, max_tokens=1)
    s.add_request(again)
    out, _ = step(s, w)
    assert again.num_cached_prompt_tokens == 12  # 3 blocks: 1 of the prompt's, 2 decoded
    assert out.num_scheduled_tokens == {"again": 3}
    finish_all(s)


def test_no_prefix_hit_with_caching_off() -> None:
    s, w = make_scheduler(prefix=False), FakeWorkers()
    s.add_request(make_req("first", prompt(10), 0, max_tokens=1))
    step(s, w)
    again = make_req("again", prompt(10), 1, max_tokens=1)
    s.add_request(again)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"again": 10}
    assert again.num_cached_prompt_tokens == 0
    s.kv.pool.check_all_free()


def test_siblings_wait_for_the_leader_then_share_its_prompt_blocks() -> None:
    s, w = make_scheduler(prefix=True, max_num_batched_tokens=8), FakeWorkers()
    leader = make_req("x#0", prompt(10), 0)
    sibling = make_req("x#1", prompt(10), 1, leader_id="x#0")
    other = make_req("y", [7, 8], 2)
    for r in (leader, sibling, other):
        s.add_request(r)

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"x#0": 8}
    out, _ = step(s, w)
    # The leader's last chunk; the sibling is passed over (FCFS kept), y is admitted.
    assert out.num_scheduled_tokens == {"x#0": 2, "y": 2}
    assert list(s.waiting) == [sibling]
    assert leader.block_ids == [0, 1, 2]

    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"x#0": 1, "y": 1, "x#1": 2}
    assert out.new_requests == [NewRequestData("x#1", prompt(10), [], sibling.sampling_params, [0, 1, 4], 8)]
    assert sibling.num_cached_prompt_tokens == 8
    assert sibling.leader_id is None
    assert s.kv.pool.ref_cnt[:5] == [2, 2, 1, 1, 1]
    assert sibling.output_token_ids == [100]
    finish_all(s)


def test_sibling_of_a_finished_leader_does_not_wait() -> None:
    s, w = make_scheduler(prefix=True), FakeWorkers()
    s.add_request(make_req("x#0", prompt(10), 0))
    sibling = make_req("x#1", prompt(10), 1, leader_id="x#0")
    s.add_request(sibling)
    s.finish_request("x#0", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"x#1": 10}
    finish_all(s)


def test_siblings_do_not_wait_with_caching_off() -> None:
    s, w = make_scheduler(prefix=False), FakeWorkers()
    s.add_request(make_req("x#0", prompt(10), 0))
    s.add_request(make_req("x#1", prompt(10), 1, leader_id="x#0"))
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"x#0": 10, "x#1": 10}
    finish_all(s)


def test_stats() -> None:
    s, w = make_scheduler(num_blocks=8), FakeWorkers()
    s.add_request(make_req("a", prompt(5), 0))
    s.add_request(make_req("b", prompt(5), 1))
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    s.add_request(make_req("c", prompt(24), 2))
    step(s, w)
    assert s.stats() == {"num_running": 2, "num_waiting": 0, "kv_blocks_total": 8, "kv_blocks_free": 0,
                         "kv_blocks_cached": 0, "kv_usage": 1.0, "num_preemptions": 0}
    finish_all(s)
