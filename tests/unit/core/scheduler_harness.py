"""A harness for driving the Scheduler step by step with a fake runner (the scheduler tests).

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
from tandem.workers.core.scheduler_output import RunnerOutput, SchedulerOutput

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
