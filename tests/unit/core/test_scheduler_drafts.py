"""Scheduler: lookahead slots and speculative draft tokens (scheduled, accepted, rolled back, capped)."""

from __future__ import annotations

from tandem.workers.core.request import RequestStatus
from tandem.workers.core.scheduler_output import CachedRequestData
from tests.unit.core.scheduler_harness import EOS, FakeWorkers, finish_all, make_req, make_scheduler, prompt, step


# --- lookahead and draft tokens ---------------------------------------------------------------
def test_lookahead_slots_are_reserved_for_decodes() -> None:
    s, w = make_scheduler(lookahead=3), FakeWorkers()
    a = make_req("a", prompt(4), 0)
    s.add_request(a)
    out, _ = step(s, w)
    assert a.block_ids == [0]  # a prefill reserves no lookahead
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 1}
    assert a.block_ids == [0, 1]  # num_tokens 5 + 3 lookahead = 8 slots
    out, _ = step(s, w)
    assert a.block_ids == [0, 1, 2]  # 6 + 3 = 9 slots
    out, _ = step(s, w)
    assert a.block_ids == [0, 1, 2]  # 7 + 3 = 10 slots
    finish_all(s)


def test_draft_tokens_are_scheduled_and_rejected_ones_rolled_back() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a = make_req("a", [1, 3, 4, 5], 0)
    s.add_request(a)
    step(s, w)
    assert (a.num_tokens, a.num_computed_tokens, a.block_ids) == (5, 4, [0])

    a.spec_token_ids = [20, 21, 22, 23, 24]
    out, updates = step(s, w, tokens={"a": 30}, accept={"a": 1})
    assert out.num_scheduled_tokens == {"a": 6}  # 1 + 5 drafts
    assert out.spec_token_ids == {"a": [20, 21, 22, 23, 24]}
    assert out.cached_requests == [CachedRequestData("a", [100], [1, 2], 4, 1)]
    # One draft accepted + the bonus token; the 4 rejected drafts are rolled back and
    # the block they alone needed is freed.
    assert [u.new_token_ids for u in updates] == [[20, 30]]
    assert a.output_token_ids == [100, 20, 30]
    assert (a.num_tokens, a.num_computed_tokens) == (7, 6)
    assert a.block_ids == [0, 1]
    assert s.kv.pool.ref_cnt[:3] == [1, 1, 0]
    assert a.spec_token_ids == []
    finish_all(s)


def test_all_drafts_accepted() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a = make_req("a", [1, 3, 4, 5], 0)
    s.add_request(a)
    step(s, w)
    a.spec_token_ids = [20, 21, 22]
    out, updates = step(s, w, tokens={"a": 30}, accept={"a": 3})
    assert out.num_scheduled_tokens == {"a": 4}
    assert [u.new_token_ids for u in updates] == [[20, 21, 22, 30]]
    assert (a.num_tokens, a.num_computed_tokens, a.block_ids) == (9, 8, [0, 1])
    out, _ = step(s, w)
    assert out.cached_requests == [CachedRequestData("a", [20, 21, 22, 30], [2], 8, 2)]
    finish_all(s)


def test_draft_tokens_are_capped_by_max_tokens() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a = make_req("a", [1, 3, 4, 5], 0, max_tokens=3)
    s.add_request(a)
    step(s, w)
    a.spec_token_ids = [20, 21, 22]
    out, updates = step(s, w, tokens={"a": 30}, accept={"a": 1})
    assert out.spec_token_ids == {"a": [20]}  # 2 tokens left: one draft + the bonus
    assert out.num_scheduled_tokens == {"a": 2}
    assert a.output_token_ids == [100, 20, 30]
    assert a.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_draft_tokens_are_dropped_for_prefills_and_when_the_budget_is_short() -> None:
    s, w = make_scheduler(max_num_seqs=1, max_num_batched_tokens=4), FakeWorkers()
    a = make_req("a", prompt(6), 0)
    s.add_request(a)
    out, _ = step(s, w)
    assert out.num_scheduled_tokens == {"a": 4}
    a.spec_token_ids = [20, 21]  # a is still in its prefill
    out, _ = step(s, w)
    assert out.spec_token_ids == {} and out.num_scheduled_tokens == {"a": 2}
    assert a.spec_token_ids == []
    a.spec_token_ids = [20, 21, 22, 23]  # 1 + 4 > the budget of 4
    out, _ = step(s, w)
    assert out.spec_token_ids == {} and out.num_scheduled_tokens == {"a": 1}
    a.spec_token_ids = [20, 21, 22]  # 1 + 3 fits
    out, _ = step(s, w, accept={"a": 3})
    assert out.spec_token_ids == {"a": [20, 21, 22]} and out.num_scheduled_tokens == {"a": 4}
    finish_all(s)


def test_stop_inside_accepted_drafts() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a = make_req("a", [1, 3, 4, 5], 0)
    s.add_request(a)
    step(s, w)
    a.spec_token_ids = [20, EOS, 22]
    _, updates = step(s, w, tokens={"a": 30}, accept={"a": 3})
    assert [u.new_token_ids for u in updates] == [[20, EOS]]
    assert a.output_token_ids == [100, 20, EOS]
    assert a.status == RequestStatus.FINISHED_STOPPED
    s.kv.pool.check_all_free()


def test_workers_block_tables_stay_exact_after_a_trim() -> None:
    # Trimmed tail blocks were already sent: the next diff cuts the workers' table.
    s, w = make_scheduler(), FakeWorkers()
    a = make_req("a", [1, 3, 4, 5], 0)
    s.add_request(a)
    step(s, w)
    a.spec_token_ids = [20, 21, 22, 23, 24]
    step(s, w, accept={"a": 0})  # blocks [0, 1, 2], trimmed to [0, 1]
    assert a.block_ids == [0, 1]
    assert w.states["a"].block_ids == [0, 1, 2]
    diffs = []
    for _ in range(4):
        out, _ = step(s, w)  # step() checks the workers' table every step
        diffs += out.cached_requests
    # Position 8 needs a third block again: the LRU head (3), not the trimmed 2.
    assert diffs == [CachedRequestData("a", [101], [], 5, 2), CachedRequestData("a", [102], [], 6, 2),
                     CachedRequestData("a", [103], [], 7, 2), CachedRequestData("a", [104], [3], 8, 2)]
    assert a.block_ids == [0, 1, 3]
    finish_all(s)
