"""Scheduler scenarios driven step by step with a fake runner.

`FakeWorkers` keeps the workers' view of each request the way ModelRunner does
(new requests in full, cached ones as diffs, finished ids dropped) and samples a
token for a request only when its scheduled tokens reach its last known token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.workers.config import CacheConfig, SchedulerConfig
from tandem.workers.core.block_pool import BlockPool, LocalCapacity
from tandem.workers.core.request import Request, RequestStatus, SamplingParams
from tandem.workers.core.scheduler import Scheduler, StepUpdate
from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput

BS = 4
EOS = 2


def make_scheduler(num_blocks: int = 16, *, prefix: bool = False, max_num_seqs: int = 4,
                   max_num_batched_tokens: int = 64, chunked: bool = True, lookahead: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=chunked, num_lookahead_slots=lookahead)
    cache = CacheConfig(block_size=BS, num_kv_blocks=num_blocks, enable_prefix_caching=prefix)
    return Scheduler(config, cache, BlockPool(LocalCapacity(num_blocks), num_blocks))


def make_req(req_id: str, prompt: list[int], arrival: int, *, max_tokens: int | None = 16,
             leader_id: str | None = None, max_model_len: int = 1 << 30, **params: object) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params), arrival,
                   eos_token_ids=(EOS,), max_model_len=max_model_len, leader_id=leader_id)


@dataclass
class WorkerState:
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class FakeWorkers:
    states: dict[str, WorkerState] = field(default_factory=dict)

    def apply(self, out: SchedulerOutput) -> dict[str, int]:
        """Apply the step message; returns num_computed_tokens before the step per request."""
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in out.new_requests:
            self.states[new.req_id] = WorkerState(new.prompt_token_ids + new.output_token_ids, list(new.block_ids))
            computed[new.req_id] = new.num_computed_tokens
        for diff in out.cached_requests:
            state = self.states[diff.req_id]
            state.token_ids += diff.new_token_ids
            del state.block_ids[diff.num_kept_blocks:]
            state.block_ids += diff.new_block_ids
            computed[diff.req_id] = diff.num_computed_tokens
        assert set(computed) == set(out.num_scheduled_tokens)
        return computed


def step(s: Scheduler, workers: FakeWorkers, tokens: dict[str, int] | None = None,
         accept: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[StepUpdate]]:
    """schedule -> workers -> fake sampling -> update.

    A request whose step reaches its last known token samples tokens[req_id]
    (default 100 + its number of outputs so far), after accept[req_id] accepted drafts.
    """
    out = s.schedule()
    computed = workers.apply(out)
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        state = workers.states[req_id]
        # The diffs rebuild exactly the scheduler's view of the request.
        assert state.block_ids == s.requests[req_id].block_ids, req_id
        assert state.token_ids == s.requests[req_id].all_token_ids, req_id
        drafts = out.spec_token_ids.get(req_id, [])
        end = computed[req_id] + out.num_scheduled_tokens[req_id] - len(drafts)
        if end < len(state.token_ids):
            sampled.append([])  # a prefill chunk that stops short of the last token
            continue
        num_outputs = len(s.requests[req_id].output_token_ids)
        bonus = (tokens or {}).get(req_id, 100 + num_outputs + (accept or {}).get(req_id, 0))
        sampled.append(drafts[:(accept or {}).get(req_id, 0)] + [bonus])
    updates = s.update(out, RunnerOutput(req_ids, sampled, [None] * len(req_ids)))
    return out, updates


def finish_all(s: Scheduler) -> None:
    for req_id in list(s.requests):
        s.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
    assert s.running == [] and list(s.waiting) == []
    s.kv.pool.check_all_free()


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


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


# --- stop conditions --------------------------------------------------------------------------

def run_to_end(s: Scheduler, w: FakeWorkers, req: Request, tokens: list[int]) -> list[int]:
    s.add_request(req)
    emitted: list[int] = []
    for token in tokens:
        _, updates = step(s, w, tokens={req.request_id: token})
        emitted += [t for u in updates for t in u.new_token_ids]
        if req.status.is_finished:
            break
    return emitted


def test_eos_stops() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0)
    assert run_to_end(s, w, req, [5, EOS, 6]) == [5, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [5, EOS]
    assert s.num_unfinished == 0
    s.kv.pool.check_all_free()


def test_ignore_eos() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=3, ignore_eos=True)
    assert run_to_end(s, w, req, [EOS, EOS, EOS, EOS]) == [EOS, EOS, EOS]
    assert req.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_stop_token_ids() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, stop_token_ids=[9])
    assert run_to_end(s, w, req, [5, 6, 9, 7]) == [5, 6, 9]
    assert req.status == RequestStatus.FINISHED_STOPPED
    s.kv.pool.check_all_free()


def test_max_tokens() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=3)
    assert run_to_end(s, w, req, [5, 6, 7, 8]) == [5, 6, 7]
    assert req.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_max_model_len() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=None, max_model_len=5)
    assert run_to_end(s, w, req, [5, 6, 7]) == [5, 6]
    assert req.status == RequestStatus.FINISHED_LENGTH
    s.kv.pool.check_all_free()


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, min_tokens=3, stop_token_ids=[9])
    assert run_to_end(s, w, req, [EOS, 9, EOS, 7]) == [EOS, 9, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    s.kv.pool.check_all_free()


def test_length_ends_even_before_min_tokens_would_allow_a_stop() -> None:
    s, w = make_scheduler(), FakeWorkers()
    req = make_req("a", prompt(3), 0, max_tokens=2, min_tokens=2)
    assert run_to_end(s, w, req, [EOS, EOS]) == [EOS, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED  # the stop check comes first
    s.kv.pool.check_all_free()


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


# ---- scheduling ahead on tokens still on the device ---------------------------------------------
def _run_prefill(s: Scheduler, req: Request) -> SchedulerOutput:
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens == {req.request_id: len(req.prompt_token_ids)}
    return out


def test_scheduling_ahead_puts_a_placeholder_that_update_replaces() -> None:
    from tandem.workers.core.request import PENDING_TOKEN

    s = make_scheduler()
    req = make_req("a", [5, 6, 7], 0)
    first = _run_prefill(s, req)  # in flight: it samples the first output token
    ahead = s.schedule(frozenset({"a"}))  # launched before that token is known
    assert ahead.num_scheduled_tokens == {"a": 1}
    assert req.output_token_ids == [PENDING_TOKEN] and req.num_pending == 1
    [diff] = ahead.cached_requests
    assert (diff.new_token_ids, diff.num_computed_tokens) == ([PENDING_TOKEN], 3)
    [update] = s.update(first, RunnerOutput(["a"], [[42]], [None]))
    assert update.new_token_ids == [42]
    assert req.output_token_ids == [42] and req.num_pending == 0 and req.num_computed_tokens == 4
    s.update(ahead, RunnerOutput(["a"], [[43]], [None]))
    assert req.output_token_ids == [42, 43]
    nxt = s.schedule()
    assert nxt.cached_requests[0].new_token_ids == [43]  # the workers get only what they lack


def test_a_token_that_must_be_the_last_is_not_scheduled_ahead() -> None:
    s = make_scheduler()
    req = make_req("a", [5, 6, 7], 0, max_tokens=1)
    first = _run_prefill(s, req)
    ahead = s.schedule(frozenset({"a"}))
    assert ahead.num_scheduled_tokens == {} and req.output_token_ids == [] and req.num_pending == 0
    [update] = s.update(first, RunnerOutput(["a"], [[42]], [None]))
    assert req.status == RequestStatus.FINISHED_LENGTH and update.new_token_ids == [42]


def test_scheduling_ahead_never_preempts() -> None:
    s = make_scheduler(num_blocks=2)
    a, b = make_req("a", [5, 6, 7, 8], 0), make_req("b", [9, 10, 11], 1)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()  # both prefills: all 2 blocks in use, a's next token needs a third
    assert first.num_scheduled_tokens == {"a": 4, "b": 3}
    ahead = s.schedule(frozenset({"a", "b"}))
    assert ahead.num_scheduled_tokens == {"b": 1}  # a waits instead of preempting b
    assert a.output_token_ids == [] and a.num_pending == 0 and a.status == RequestStatus.RUNNING
    s.update(first, RunnerOutput(["a", "b"], [[42], [43]], [None, None]))
    assert a.output_token_ids == [42] and b.output_token_ids == [43]
    assert s.num_preemptions == 0


def test_blocks_holding_a_pending_token_are_not_hashed() -> None:
    s = make_scheduler(prefix=True)
    req = make_req("a", [5, 6, 7], 0)  # the pending token completes the first block
    first = _run_prefill(s, req)
    s.schedule(frozenset({"a"}))
    s.kv.cache_blocks(req)
    assert s.kv.pool.num_cached_blocks == 0
    s.update(first, RunnerOutput(["a"], [[42]], [None]))
    assert s.kv.pool.num_cached_blocks == 1  # hashed once its token is known


# --- multi-step decoding --------------------------------------------------------------------------

def greedy_req(req_id: str, prompt_ids: list[int], arrival: int, **params: object) -> Request:
    return make_req(req_id, prompt_ids, arrival, **{"temperature": 0.0, **params})


def multi_step(s: Scheduler, workers: FakeWorkers, max_steps: int,
               tokens: dict[str, list[int]] | None = None) -> tuple[SchedulerOutput, list[StepUpdate]]:
    """schedule(max_steps) -> workers -> every request samples a token per pass (default 100 +
    its number of outputs so far, counting up) -> update."""
    out = s.schedule(max_steps=max_steps)
    workers.apply(out)
    req_ids = list(out.num_scheduled_tokens)
    for req_id in req_ids:
        assert workers.states[req_id].block_ids == s.requests[req_id].block_ids, req_id
    sampled = []
    for req_id in req_ids:
        first = 100 + len(s.requests[req_id].output_token_ids)
        sampled.append((tokens or {}).get(req_id, list(range(first, first + out.num_steps))))
    return out, s.update(out, RunnerOutput(req_ids, sampled, [None] * len(req_ids)))


def test_multi_step_decodes_run_several_passes_on_slots_allocated_ahead() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a, b = greedy_req("a", prompt(5), 0, max_tokens=10), greedy_req("b", prompt(3), 1, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    out, _ = multi_step(s, w, 4)
    assert out.num_steps == 1  # an admission: one pass
    assert (a.block_ids, b.block_ids) == ([0, 1], [2])

    out, updates = multi_step(s, w, 4)
    assert out.num_steps == 4
    # Slots for four tokens each: a (6 tokens, computed 5) needs ceil(9 / 4) = 3 blocks, b ceil(7 / 4) = 2.
    assert out.cached_requests == [CachedRequestData("a", [100], [3], 5, 2), CachedRequestData("b", [100], [4], 3, 1)]
    assert out.num_context_tokens == (6 + 7 + 8 + 9) + (4 + 5 + 6 + 7)
    assert out.num_attention_pairs == out.num_context_tokens
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("a", [101, 102, 103, 104]),
                                                                          ("b", [101, 102, 103, 104])]
    assert (a.num_computed_tokens, a.num_tokens) == (9, 10)
    assert (b.num_computed_tokens, b.num_tokens) == (7, 8)

    out, _ = multi_step(s, w, 4)  # the next diff carries the four tokens, and the workers' view is exact
    assert out.num_steps == 4
    assert out.cached_requests == [CachedRequestData("a", [101, 102, 103, 104], [5], 9, 3),
                                   CachedRequestData("b", [101, 102, 103, 104], [6], 7, 2)]
    assert w.states["a"].token_ids == prompt(5) + [100, 101, 102, 103, 104]
    finish_all(s)


def test_a_request_near_its_max_tokens_keeps_only_its_tokens_up_to_the_limit() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a, b = greedy_req("a", prompt(5), 0, max_tokens=3), greedy_req("b", prompt(3), 1, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    multi_step(s, w, 4)
    out, updates = multi_step(s, w, 4)
    assert out.num_steps == 4  # a has room for two more tokens: its last two passes are dropped
    assert [u.new_token_ids for u in updates] == [[101, 102], [101, 102, 103, 104]]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [100, 101, 102]
    assert a.block_ids == []
    out, _ = multi_step(s, w, 4)
    assert out.num_steps == 4 and list(out.num_scheduled_tokens) == ["b"]
    finish_all(s)


def test_multi_step_passes_stop_at_the_model_length() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a = greedy_req("a", prompt(5), 0, max_tokens=None, max_model_len=8)
    b = greedy_req("b", prompt(3), 1, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    multi_step(s, w, 4)
    out, updates = multi_step(s, w, 4)
    assert out.num_steps == 2  # a's positions end at the model's length (8 tokens): two more
    assert [u.new_token_ids for u in updates] == [[101, 102], [101, 102]]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [100, 101, 102]
    finish_all(s)


def test_a_stop_token_inside_a_multi_step_step_drops_the_tokens_after_it() -> None:
    s, w = make_scheduler(), FakeWorkers()
    a = greedy_req("a", prompt(5), 0, max_tokens=10)
    s.add_request(a)
    multi_step(s, w, 4)
    out, updates = multi_step(s, w, 4, tokens={"a": [101, EOS, 103, 104]})
    assert out.num_steps == 4
    assert updates[0].new_token_ids == [101, EOS]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [100, 101, EOS]
    assert a.block_ids == [] and s.running == []
    s.kv.pool.check_all_free()


def test_multi_step_only_for_running_decodes_with_room() -> None:
    def second_step(*reqs: Request, num_blocks: int = 16, late: Request | None = None) -> int:
        s, w = make_scheduler(num_blocks), FakeWorkers()
        for req in reqs:
            s.add_request(req)
        multi_step(s, w, 4)
        if late is not None:
            s.add_request(late)
        out = s.schedule(max_steps=4)
        return out.num_steps

    assert second_step(greedy_req("a", prompt(5), 0)) == 4
    assert second_step(greedy_req("a", prompt(5), 0), late=greedy_req("b", prompt(3), 1)) == 1  # an admission
    assert second_step(greedy_req("a", prompt(5), 0), greedy_req("b", prompt(3), 1, temperature=0.8, seed=3)) == 4
    assert second_step(greedy_req("a", prompt(5), 0, logprobs=2)) == 4  # taken on the device pass by pass
    assert second_step(greedy_req("a", prompt(5), 0, prompt_logprobs=1)) == 4  # its prompt scored already
    assert second_step(greedy_req("a", prompt(5), 0, repetition_penalty=1.2)) == 4  # counted on the device
    assert second_step(greedy_req("a", prompt(5), 0, min_tokens=3)) == 4  # EOS suppressed on the device
    assert second_step(greedy_req("a", prompt(30), 0, max_tokens=8), num_blocks=8) == 1  # no block for 3 more slots
    assert second_step(greedy_req("a", prompt(30), 0, max_tokens=8), num_blocks=9) == 4


# --- multi-step steps scheduled ahead ---------------------------------------------------------------

def _in_flight_multi_step(a: Request, num_blocks: int = 16) -> tuple[Scheduler, SchedulerOutput]:
    """`a`'s prefill done (output [100]), then a multi-step step launched and not yet collected."""
    s, w = make_scheduler(num_blocks), FakeWorkers()
    s.add_request(a)
    multi_step(s, w, 4)
    first = s.schedule(max_steps=4)
    assert first.num_steps == 4
    return s, first


def test_a_multi_step_step_scheduled_ahead_gets_a_placeholder_a_pass() -> None:
    from tandem.workers.core.request import PENDING_TOKEN as P

    a = greedy_req("a", prompt(5), 0, max_tokens=20)
    s, first = _in_flight_multi_step(a)
    ahead = s.schedule(frozenset({"a"}), max_steps=4, num_ahead=4)
    assert ahead.num_steps == 4  # scheduled on the last of the four placeholders, four passes again
    assert a.output_token_ids == [100, P, P, P, P] and a.num_pending == 4
    # Its KV slots: 13 tokens computed by its end -> ceil(13 / 4) = 4 blocks.
    assert ahead.cached_requests == [CachedRequestData("a", [P, P, P, P], [3], 9, 3)]
    [update] = s.update(first, RunnerOutput(["a"], [[101, 102, 103, 104]], [None]))
    assert update.new_token_ids == [101, 102, 103, 104]
    assert a.output_token_ids == [100, 101, 102, 103, 104] and a.num_pending == 0
    assert (a.num_computed_tokens, a.status) == (13, RequestStatus.RUNNING)
    [update] = s.update(ahead, RunnerOutput(["a"], [[105, 106, 107, 108]], [None]))
    assert a.output_token_ids == [100, 101, 102, 103, 104, 105, 106, 107, 108]
    nxt = s.schedule(max_steps=4)
    assert nxt.cached_requests[0].new_token_ids == [105, 106, 107, 108]  # the workers lack only these
    finish_all(s)


def test_a_stop_inside_the_step_in_flight_takes_the_placeholders_after_it_away() -> None:
    a = greedy_req("a", prompt(5), 0, max_tokens=20)
    s, first = _in_flight_multi_step(a)
    ahead = s.schedule(frozenset({"a"}), max_steps=4, num_ahead=4)
    [update] = s.update(first, RunnerOutput(["a"], [[101, EOS, 103, 104]], [None]))
    assert update.new_token_ids == [101, EOS]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [100, 101, EOS]
    assert a.num_pending == 0 and a.block_ids == []
    assert s.update(ahead, RunnerOutput(["a"], [[105, 106, 107, 108]], [None])) == []  # finished: ignored
    s.kv.pool.check_all_free()


def test_the_length_limit_counts_known_tokens_not_placeholders() -> None:
    a = greedy_req("a", prompt(5), 0, max_tokens=9)  # 14 tokens at most
    s, first = _in_flight_multi_step(a)
    ahead = s.schedule(frozenset({"a"}), max_steps=4, num_ahead=4)
    assert ahead.num_steps == 4  # 10 tokens with the placeholders: room for four more
    s.update(first, RunnerOutput(["a"], [[101, 102, 103, 104]], [None]))
    assert a.status == RequestStatus.RUNNING  # 10 tokens known, not 14
    [update] = s.update(ahead, RunnerOutput(["a"], [[105, 106, 107, 108]], [None]))
    assert a.status == RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 9
    s.kv.pool.check_all_free()


def test_no_placeholders_when_the_step_in_flight_ends_the_request() -> None:
    a = greedy_req("a", prompt(5), 0, max_tokens=5)  # the step in flight makes tokens 2-5, its last
    s, first = _in_flight_multi_step(a)
    ahead = s.schedule(frozenset({"a"}), max_steps=4, num_ahead=4)
    assert ahead.num_scheduled_tokens == {} and a.output_token_ids == [100] and a.num_pending == 0
    s.update(first, RunnerOutput(["a"], [[101, 102, 103, 104]], [None]))
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [100, 101, 102, 103, 104]
    s.kv.pool.check_all_free()


def test_a_request_without_room_ahead_runs_one_pass_or_gives_its_placeholders_back() -> None:
    # a: 9 tokens computed in 3 blocks; its next token fits there, four more passes need a 4th block.
    a = greedy_req("a", prompt(5), 0, max_tokens=20)
    s, _ = _in_flight_multi_step(a, num_blocks=3)
    ahead = s.schedule(frozenset({"a"}), max_steps=4, num_ahead=4)
    assert ahead.num_scheduled_tokens == {"a": 1} and ahead.num_steps == 1
    # b: 8 tokens computed in 2 blocks, all there are; its next token needs a 3rd: it waits.
    b = greedy_req("b", prompt(4), 0, max_tokens=20)
    s2, first = _in_flight_multi_step(b, num_blocks=2)
    ahead = s2.schedule(frozenset({"b"}), max_steps=4, num_ahead=4)
    assert ahead.num_scheduled_tokens == {} and b.output_token_ids == [100] and b.num_pending == 0
    s2.update(first, RunnerOutput(["b"], [[101, 102, 103, 104]], [None]))
    assert b.output_token_ids == [100, 101, 102, 103, 104] and s2.num_preemptions == 0
    finish_all(s)
    finish_all(s2)
