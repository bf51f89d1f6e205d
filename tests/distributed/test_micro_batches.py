"""How a worker splits one step into pipeline micro-batches (pure, no Ray)."""

from __future__ import annotations

from tandem.workers.core.request import SamplingParams
from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from tandem.workers.executor.worker import merge_outputs, split_micro_batches


def _step(tokens: dict[str, int]) -> SchedulerOutput:
    new = [NewRequestData(r, [1] * n, [], SamplingParams(), [0], 0) for r, n in tokens.items() if r.startswith("n")]
    cached = [CachedRequestData(r, [5], [], 10, 1) for r in tokens if r.startswith("c")]
    return SchedulerOutput(7, new_requests=new, cached_requests=cached, num_scheduled_tokens=dict(tokens),
                           spec_token_ids={"c1": [3]}, finished_req_ids={"gone"})


def test_one_stage_or_one_request_is_not_split() -> None:
    step = _step({"c0": 1, "c1": 2})
    assert split_micro_batches(step, 1) == [step]
    single = _step({"n0": 40})
    assert split_micro_batches(single, 4) == [single]


def test_split_balances_tokens_and_keeps_request_order() -> None:
    step = _step({"c0": 1, "c1": 2, "c2": 1, "n0": 12, "n1": 16})
    batches = split_micro_batches(step, 2)
    assert [list(b.num_scheduled_tokens) for b in batches] == [["c0", "c1", "c2", "n0"], ["n1"]]
    assert [b.total_num_scheduled_tokens for b in batches] == [16, 16]
    first, second = batches
    assert [r.req_id for r in first.cached_requests] == ["c0", "c1", "c2"]
    assert [r.req_id for r in first.new_requests] == ["n0"] and first.spec_token_ids == {"c1": [3]}
    assert [r.req_id for r in second.new_requests] == ["n1"] and second.spec_token_ids == {}
    # State changes (finished ids) were applied once for the whole step; batches carry none.
    assert all(b.finished_req_ids == set() and b.step_id == 7 for b in batches)


def test_decodes_split_evenly_over_stages() -> None:
    step = _step({f"c{i}": 1 for i in range(8)})
    assert [len(b.num_scheduled_tokens) for b in split_micro_batches(step, 4)] == [2, 2, 2, 2]
    assert [len(b.num_scheduled_tokens) for b in split_micro_batches(step, 3)] == [3, 2, 3]


def test_a_dominant_request_leaves_no_empty_batch() -> None:
    batches = split_micro_batches(_step({"n0": 100, "c0": 1}), 3)
    assert [list(b.num_scheduled_tokens) for b in batches] == [["n0"], ["c0"]]


def test_merge_concatenates_in_batch_order() -> None:
    a = RunnerOutput(["x"], [[1]], [None], 2, 1)
    b = RunnerOutput(["y", "z"], [[2], []], [None, None], 1, 0)
    merged = merge_outputs([a, b])
    assert merged.req_ids == ["x", "y", "z"] and merged.sampled_token_ids == [[1], [2], []]
    assert (merged.num_draft_tokens, merged.num_accepted_draft_tokens) == (3, 1)
