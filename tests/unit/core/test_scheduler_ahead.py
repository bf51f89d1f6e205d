"""Scheduler: steps scheduled ahead on tokens still on the device (placeholders), and multi-step
decoding, alone and scheduled ahead."""

from __future__ import annotations

from tandem.workers.core.request import Request, RequestStatus
from tandem.workers.core.scheduler import Scheduler, StepUpdate
from tandem.workers.core.scheduler_output import CachedRequestData, RunnerOutput, SchedulerOutput
from tests.unit.core.scheduler_harness import EOS, FakeWorkers, finish_all, make_req, make_scheduler, prompt


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
