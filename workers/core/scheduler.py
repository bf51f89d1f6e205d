"""Iteration-level continuous batching over a paged KV cache.

There is no separate prefill or decode phase: each request has
`num_computed_tokens`, and a step gives it `num_tokens - num_computed_tokens`
more (capped by the token budget), so a long prompt is chunked across steps and
mixed with decodes. Order within a step:

  1. running requests that are decoding (so a long prefill never starves them),
  2. running requests in the middle of a chunked prefill,
  3. waiting requests, first come first served, while budget, seats and blocks last.

When blocks run out, the latest-arrived running request is preempted: its blocks
are freed and it is recomputed later (its output so far is kept, so the result is
unchanged). `num_computed_tokens` advances when a step is scheduled and rolls back
in `update` for rejected draft tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tandem.workers.config import CacheConfig, SchedulerConfig
from tandem.workers.core.block_pool import BlockPool
from tandem.workers.core.kv_cache_manager import KVCacheManager
from tandem.workers.core.request import PENDING_TOKEN, Request, RequestStatus, token_slice
from tandem.workers.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)


@dataclass(slots=True)
class StepUpdate:
    """What one step did to one request, for the engine's output processing."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, pool: BlockPool) -> None:
        self.config = config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(pool, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._sent_tokens: dict[str, int] = {}  # req_id -> tokens the workers know
        self._block_ids_sent: dict[str, int] = {}  # req_id -> blocks the workers know
        self._finished_since_last_step: set[str] = set()
        self._step_id = 0
        # Cumulative counters for monitoring (workers/core/stats.py), in tokens.
        self.num_preemptions = 0
        self.num_preempted_waiting = 0  # preempted requests waiting to be recomputed now
        self.num_prompt_tokens = 0  # prompts at first admission (cached tokens included)
        self.num_prefix_hit_tokens = 0  # of those, found in the prefix cache (device or host)
        self.num_generated_tokens = 0

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length, abort, error) a request at any time; frees its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        assert status.is_finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
            if req.status == RequestStatus.PREEMPTED:
                self.num_preempted_waiting -= 1
        req.status = status
        req.spec_token_ids = []
        self.kv.free(req)
        self._forget_sent(req_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, ahead: frozenset[str] = frozenset(), max_steps: int = 1, num_ahead: int = 1,
                 slot: int | None = None, num_slots: int = 1) -> SchedulerOutput:
        """The next step. `ahead`: requests whose next `num_ahead` tokens a step still on the
        device has sampled (one a pass of a multi-step step); each gets as many PENDING_TOKENs
        in their place (unless the last of them must be its last token) and is scheduled on
        them, so this step can be launched before that one's tokens are back. Scheduling ahead
        never preempts: a request that finds no room waits a step. `max_steps` > 1: a step of
        running decodes alone may run up to that many forward passes (multi-step decoding,
        `SchedulerOutput.num_steps`).

        `slot` (pipeline stages kept busy: `num_slots` steps in flight at once): only the
        running requests of that slot are scheduled, waiting ones join it while it holds less
        than its share of max_num_seqs, and preemption takes its victims from it alone, since
        the other slots' requests may be in a step still on the workers. So a request never has
        two steps in flight."""
        out = SchedulerOutput(step_id=self._step_id)
        self._step_id += 1
        budget = self.config.max_num_batched_tokens
        preempted = False
        assert not (ahead and slot is not None), "pipeline slots are never scheduled ahead"
        placeholders: list[Request] = []
        pending_tokens = [PENDING_TOKEN] * num_ahead
        # (request, its tokens, KV slots to reserve past them): decodes first, then prefill
        # chunks. This loop runs for every running request every step, so the lengths are read
        # once here, and a request scheduled ahead gets its placeholders here too.
        decoding: list[tuple[Request, int, int]] = []
        prefilling: list[tuple[Request, int, int]] = []
        lookahead = self.config.num_lookahead_slots
        candidates = self.running if slot is None else [r for r in self.running if r.pp_slot == slot]
        for req in candidates:
            outputs = req.output_token_ids
            num_tokens = len(req.prompt_token_ids) + len(outputs)
            if ahead and req.request_id in ahead and num_tokens + num_ahead < req.max_total_tokens:
                outputs += pending_tokens
                req.num_pending = num_ahead
                num_tokens += num_ahead
                placeholders.append(req)
            if req.num_computed_tokens < num_tokens - 1:
                prefilling.append((req, num_tokens, 0))
            else:
                decoding.append((req, num_tokens, lookahead))
        scheduled: list[Request] = []
        running = RequestStatus.RUNNING
        block_size = self.block_size
        for req, num_tokens, num_lookahead in decoding + prefilling:
            if budget <= 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            num_new = min(num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue  # ahead: its next token is still on the device and must be its last
            if req.spec_token_ids:
                # Drafts ride along only with a whole decode, and never past the length limit.
                room = req.max_total_tokens - num_tokens - 1
                fits = num_new == 1 and budget > len(req.spec_token_ids)
                req.spec_token_ids = req.spec_token_ids[:max(0, room)] if fits else []
                num_new += len(req.spec_token_ids)
            # A decode whose blocks still have room (15 steps in 16 at block size 16) needs no call.
            allocated = req.num_computed_tokens + num_new + num_lookahead <= len(req.block_ids) * block_size or \
                self.kv.allocate_slots(req, num_new, num_lookahead=num_lookahead) is not None
            while not allocated and not ahead:  # ahead: no preemption on guessed tokens; it waits
                victim = max((r for r in candidates if r.status is running), key=lambda r: r.arrival_seq)
                self._preempt(victim)
                preempted = True
                if victim in scheduled:
                    # NOTE: a later arrival can be scheduled before req (decodes go first);
                    # take it back out of this step, or it is sent with no blocks.
                    scheduled.remove(victim)
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                if victim is req:
                    break
                allocated = self.kv.allocate_slots(req, num_new, num_lookahead=num_lookahead) is not None
            if req.status is not running or not allocated:
                continue
            scheduled.append(req)
            budget -= num_new
            out.num_scheduled_tokens[req.request_id] = num_new
        left_out = placeholders if len(scheduled) < len(candidates) else ()
        for req in left_out:  # left out of this step after all: the token comes by update()
            if req.request_id not in out.num_scheduled_tokens:
                del req.output_token_ids[-req.num_pending:]
                req.num_pending = 0
        num_running = len(scheduled)
        if not preempted:
            budget = self._admit_waiting(out, scheduled, budget, slot, num_slots)
        if max_steps > 1 and scheduled and not preempted and len(scheduled) == num_running:
            out.num_steps = self._num_steps(out, scheduled, max_steps)
        self._add_to_output(out, scheduled)
        out.finished_req_ids, self._finished_since_last_step = self._finished_since_last_step, set()
        out.host_saves, out.host_loads = self.kv.drain_host_copies()
        return out

    def _admit_waiting(self, out: SchedulerOutput, scheduled: list[Request], budget: int, slot: int | None,
                       num_slots: int) -> int:
        skipped: list[Request] = []
        num_running = len(self.running)
        # A slot's share of the seats and of the requests there are: one slot admitting them all
        # would leave the others empty.
        seats = -(-min(self.config.max_num_seqs, len(self.running) + len(self.waiting)) // num_slots)
        in_slot = 0 if slot is None else sum(r.pp_slot == slot for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and \
                (slot is None or in_slot < seats):
            req = self.waiting.popleft()
            req.spec_token_ids = []  # drafts ride only with decodes, never with admission
            if self._must_wait_for_leader(req):
                skipped.append(req)
                continue
            hits = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            host_slots = self.kv.get_host_hits(req, len(hits)) if req.num_computed_tokens == 0 else []
            num_cached = (len(hits) + len(host_slots)) * self.block_size
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                self.waiting.appendleft(req)
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits, host_slots=host_slots) is None:
                self.waiting.appendleft(req)
                break
            if req.status == RequestStatus.WAITING:
                req.num_cached_prompt_tokens = num_cached
                req.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += req.num_prompt_tokens
                self.num_prefix_hit_tokens += num_cached
            else:
                self.num_preempted_waiting -= 1
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if slot is not None:
                req.pp_slot = slot
                in_slot += 1
            self.running.append(req)
            scheduled.append(req)
            budget -= num_new
            out.num_scheduled_tokens[req.request_id] = num_new
        # Keep FCFS order for the requests passed over.
        self.waiting.extendleft(reversed(skipped))
        if len(self.running) > num_running:  # a resumed request goes back to its place
            self.running.sort(key=lambda r: r.arrival_seq)
        return budget

    def _num_steps(self, out: SchedulerOutput, scheduled: list[Request], max_steps: int) -> int:
        """Forward passes this step may run back to back: up to `max_steps` when every request is
        a decode of one token (no drafts, no prefill chunk), none would pass the model's length
        within them, and the pool has the extra KV slots, which are allocated here. Otherwise 1.
        Sampling, penalties, logprobs and min_tokens run on the device pass by pass
        (PassSampler). A request nearer its max_tokens than that runs the passes too, and
        `update` drops its tokens past the limit, as it does those past a stop token: one
        wasted row, where bounding the step by it would cut every request's passes short each
        time one nears its end."""
        steps = max_steps
        for req in scheduled:
            if out.num_scheduled_tokens[req.request_id] != 1 or req.spec_token_ids or req.is_prefill \
                    or req.sampling_params.shapes_logits:  # grammars and logit biases: the host sampler's
                return 1
            steps = min(steps, req.max_model_len - req.num_tokens)
        if steps <= 1:
            return 1
        num_blocks = sum(max(0, self.kv.num_new_blocks(req, steps)) for req in scheduled)
        if num_blocks > self.kv.pool.num_free_blocks:
            return 1
        for req in scheduled:
            self.kv.allocate_slots(req, steps)
        return steps

    def _must_wait_for_leader(self, req: Request) -> bool:
        """n > 1: siblings wait until the first one's prompt KV is cached, then share it."""
        if req.leader_id is None or not self.kv.enable_prefix_caching:
            return False
        leader = self.requests.get(req.leader_id)
        if leader is None or leader.num_computed_tokens >= leader.num_prompt_tokens:
            req.leader_id = None
            return False
        return True

    def _add_to_output(self, out: SchedulerOutput, scheduled: list[Request]) -> None:
        """What the workers need of each scheduled request: the whole request when they have not
        seen it, else the tokens and blocks new since its last step; and the step's model-cost
        figures. Runs over every scheduled request every step: lengths are read once, and the
        dicts and sums are locals."""
        num_scheduled, sent_tokens, blocks_sent = out.num_scheduled_tokens, self._sent_tokens, self._block_ids_sent
        steps = out.num_steps
        context, pairs = out.num_context_tokens, out.num_attention_pairs
        for req in scheduled:
            req_id = req.request_id
            num_new = num_scheduled[req_id]
            prompt, outputs, block_ids = req.prompt_token_ids, req.output_token_ids, req.block_ids
            num_prompt = len(prompt)
            num_tokens = num_prompt + len(outputs)
            computed = req.num_computed_tokens
            sent = sent_tokens.get(req_id)
            if sent is None:
                out.new_requests.append(NewRequestData(
                    req_id, list(prompt), list(outputs), req.sampling_params, list(block_ids), computed))
            else:
                n_blocks = blocks_sent[req_id]
                new_tokens = outputs[sent - num_prompt:] if sent >= num_prompt else \
                    token_slice(prompt, outputs, sent, num_tokens)
                out.cached_requests.append(
                    CachedRequestData(req_id, new_tokens, block_ids[n_blocks:], computed, n_blocks))
            sent_tokens[req_id] = num_tokens
            blocks_sent[req_id] = len(block_ids)
            if req.spec_token_ids:
                out.spec_token_ids[req_id] = list(req.spec_token_ids)
            if computed < num_prompt:
                req.num_prefill_chunks += 1
            # Model cost figures: the KV this step reads, and its (query, key) pairs.
            if steps == 1:
                context += computed + num_new
                pairs += num_new * computed + num_new * (num_new + 1) // 2
                req.num_computed_tokens = computed + num_new
            else:  # one token a pass, each attending to the keys before it and itself
                keys = steps * (computed + 1) + steps * (steps - 1) // 2
                context += keys
                pairs += keys
                req.num_computed_tokens = computed + steps
        out.num_context_tokens, out.num_attention_pairs = context, pairs

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preempted_waiting += 1
        self._forget_sent(req.request_id)
        self.waiting.appendleft(req)

    def _forget_sent(self, req_id: str) -> None:
        """The workers drop this request's state at the next step (it is resent in full)."""
        self._block_ids_sent.pop(req_id, None)
        if self._sent_tokens.pop(req_id, None) is not None:
            self._finished_since_last_step.add(req_id)

    # ---- results ---------------------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, result: RunnerOutput) -> list[StepUpdate]:
        """Apply a step's sampled tokens; token-level stop checks (EOS, stop ids, length)."""
        updates: list[StepUpdate] = []
        num_generated = 0
        spec = sched_out.spec_token_ids
        requests = self.requests
        running = RequestStatus.RUNNING
        block_size = self.block_size
        for req_id, tokens, logprobs in zip(result.req_ids, result.sampled_token_ids, result.logprobs):
            req = requests.get(req_id)
            if req is None or req.status is not running:
                continue  # aborted or preempted while the step ran
            num_drafts = len(spec.get(req_id, ())) if spec else 0
            if num_drafts:
                # Drafts accepted = tokens - 1 (the bonus/corrected token); roll back the rest.
                num_rejected = num_drafts - (len(tokens) - 1)
                req.num_computed_tokens -= num_rejected
                req.spec_token_ids = []
            if not tokens:
                self.kv.cache_blocks(req)
                continue
            num_kept, status = self._take_tokens(req, tokens)
            kept = tokens if num_kept == len(tokens) else tokens[:num_kept]
            num_generated += len(kept)
            if len(kept) < len(tokens):
                # Stopped inside accepted drafts: the KV past the stop is not needed.
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            if num_drafts:
                self.kv.trim(req, req.num_tokens)
                # The workers' table still has the trimmed tail; the next diff cuts it.
                self._block_ids_sent[req_id] = min(self._block_ids_sent[req_id], len(req.block_ids))
            if req.num_computed_tokens >= (req.num_published_blocks + 1) * block_size:  # a block may be full
                self.kv.cache_blocks(req)
            updates.append(StepUpdate(req, kept, logprobs[:len(kept)] if logprobs else None))
            if status is not None:
                self.finish_request(req_id, status)
        self.num_generated_tokens += num_generated
        return updates

    @staticmethod
    def _take_tokens(req: Request, tokens: list[int]) -> tuple[int, RequestStatus | None]:
        """Append a step's tokens to the request (into its placeholders first, where a step was
        scheduled ahead on them) up to the first that ends it: how many it keeps, and why it
        ends, if it does (EOS, a stop id, its length limit; min_tokens counts known tokens)."""
        ending = req.ending_token_ids
        min_tokens = req.sampling_params.min_tokens
        max_outputs = req.max_output_tokens
        outputs = req.output_token_ids
        pending = req.num_pending
        num_known = len(outputs) - pending  # output tokens known before these
        num_kept = 0
        status = None
        for token in tokens:
            num_kept += 1
            if pending:  # scheduled ahead on it: the token takes its placeholder's place
                outputs[-pending] = token
                pending -= 1
            else:
                outputs.append(token)
            num_known += 1
            if token in ending and num_known >= min_tokens:
                status = RequestStatus.FINISHED_STOPPED
                break
            if num_known >= max_outputs:
                status = RequestStatus.FINISHED_LENGTH
                break
        if pending:  # it ended inside them: the placeholders after its last token go
            del outputs[-pending:]
        req.num_pending = 0
        return num_kept, status

    # ---- figures -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        pool, host = self.kv.pool, self.kv.host
        host_stats = {} if host is None else {"host_kv_blocks_total": host.num_slots, "host_kv_blocks_used": len(host),
                                              "host_kv_blocks_saved": host.num_saved,
                                              "host_kv_blocks_loaded": host.num_loaded,
                                              "host_kv_blocks_pinned": host.num_pinned}
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_blocks_cached": pool.num_cached_blocks,
            "kv_usage": pool.usage,
            "num_preemptions": self.num_preemptions,
            **host_stats,
        }

    def metrics_snapshot(self) -> dict[str, float]:
        """Cumulative counters and current gauges (see GroupEngine.metrics_snapshot)."""
        host = self.kv.host
        return {
            "num_running": len(self.running), "num_waiting": len(self.waiting),
            "num_preempted_waiting": self.num_preempted_waiting, "kv_usage": self.kv.pool.usage,
            "host_kv_usage": len(host) / host.num_slots if host is not None and host.num_slots else 0.0,
            "num_prompt_tokens": self.num_prompt_tokens, "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "num_generated_tokens": self.num_generated_tokens, "num_preemptions": self.num_preemptions,
        }
