"""GroupEngine: one replica group's loop of schedule -> execute -> update -> outputs.

    add_request ──> Scheduler.waiting
    step():  Scheduler.schedule() ──step message──> Executor (workers) ──RunnerOutput──>
             Scheduler.update() (token stops) ──> OutputProcessor (text, stop strings) ──> outputs

The engine is synchronous; `AsyncEngine` runs it on a thread for the server.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Protocol

from tandem.workers.config import EngineConfig
from tandem.workers.core.block_pool import BlockPool, LocalCapacity
from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import Request, RequestOutput, RequestStatus, SamplingParams
from tandem.workers.core.scheduler import Scheduler, StepUpdate
from tandem.workers.core.scheduler_output import PendingOutput, SchedulerOutput
from tandem.workers.core.stats import EngineStats
from tandem.workers.core.validation import PromptLimits, validate_prompt
from tandem.workers.device_peaks import DevicePeaks
from tandem.workers.engine.engine_dead import EngineDeadError
from tandem.workers.engine.figures import exporter_figures, keep_leader_figures, model_cost, request_metrics
from tandem.workers.engine.prompts import Prompt, sequence_id, sequences, tokenize_prompt
from tandem.workers.executor.abstract import Executor
from tandem.workers.executor.simulated import SimulatedExecutor
from tandem.workers.executor.uniproc import UniProcExecutor
from tandem.workers.kernels import kv_quant
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.spec.policy import SpeculationPolicy
from tandem.workers.startup_heap import StartupHeap
from tandem.workers.structured.grammar_cache import GrammarCompiler
from tandem.workers.structured.request_grammars import RequestGrammars
from tandem.workers.structured.spec import StructuredSpec
from tandem.workers.text.output_processor import OutputProcessor, RequestState

logger = logging.getLogger(__name__)


class Proposer(Protocol):
    """Speculative drafting: sets `spec_token_ids` on the requests it has guesses for."""

    def propose(self, requests: list[Request]) -> None: ...


class GroupEngine:
    def __init__(self, config: EngineConfig, hf_config: HFModelConfig, tokenizer, executor: Executor, *,
                 model_dir: str = "") -> None:
        self.config = config
        self.hf_config = hf_config
        self.model_dir = model_dir  # where the weights were loaded from (a rebuilt group loads them again)
        self.tokenizer = tokenizer
        self.executor = executor
        self.max_model_len = config.model.max_model_len or hf_config.max_position_embeddings
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens: must be >= max_model_len ({self.max_model_len}) "
                             "when chunked prefill is off")
        self.pool = BlockPool(LocalCapacity(executor.num_kv_blocks), executor.num_kv_blocks)
        self._log_kv_cache()
        self.scheduler = Scheduler(sched, config.cache, self.pool)
        self.prompt_limits = PromptLimits(
            vocab_size=hf_config.vocab_size, max_model_len=self.max_model_len,
            max_cached_tokens=self.pool.num_blocks * config.cache.block_size - sched.num_lookahead_slots)
        self.outputs = OutputProcessor(tokenizer)
        self.states: dict[str, RequestState] = {}
        self._arrival = itertools.count()
        self.dead_error: str | None = None
        self.proposer: Proposer | None = None
        self.prefill_tokens_per_s: float | None = None  # measured; see _note_prefill_speed
        self.spec_policy = SpeculationPolicy(disable_batch_size=config.speculative.disable_batch_size)
        self.counters = EngineStats(cost=model_cost(hf_config, config.model.dtype,
                                                    getattr(executor, "device_type", "cpu")))
        self.overlap_steps = config.model.overlaps_steps(getattr(executor, "device_type", "cpu"))
        # Steps launched and not yet collected, oldest first: (step, its output, launched at).
        # At most two, and two only inside step() while one is scheduled ahead; or, with
        # pipeline stages, up to one a stage (below).
        self._in_flight: deque[tuple[Any, PendingOutput, float]] = deque()
        # Pipeline stages kept busy (a Ray group with PP > 1): this many steps in flight, each
        # of its own slot's requests; the slot launched next, and the slots in flight.
        self.pipeline_depth = config.parallel.inflight_batches if config.parallel.pipeline_parallel_size > 1 else 1
        self._next_slot = 0
        self._slots_in_flight: dict[int, int] = {}  # step id -> slot
        self._failed_outputs: list[RequestOutput] = []
        # Multi-step decoding: a pass's device time (an EMA of decode steps, measured from one
        # step's end to the next's), which bounds a step's passes by the streams' paces.
        self.pass_s: float | None = None
        self._last_done_at = 0.0
        self._last_step_s = 0.0  # the device's time for the step collected last
        self.startup_heap: StartupHeap | None = None  # frozen once the group is assembled (builder.py)
        self._grammars: RequestGrammars | None = None  # made at the first request with a StructuredSpec

    # ---- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    pace: OutputPace | None = None) -> None:
        """Queue a request. `pace`: in delta mode, at most one output per its interval once the
        first token went (workers/core/output_pace.py)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the replica group has failed: {self.dead_error}")
        if request_id in self.states:
            raise ValueError(f"request_id: {request_id!r} is already running")
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        validate_prompt(token_ids, params, self.prompt_limits)
        if params.structured is not None:  # before anything is queued: a spec that cannot compile is refused
            self.grammars.add([sequence_id(request_id, params.n, i) for i in range(params.n)], params.structured)
        state = self.outputs.new_state(request_id, text, token_ids, params)
        state.arrival_time = arrival = time.monotonic()
        state.pace = pace
        self.states[request_id] = state
        capacity = self.pool.num_blocks * self.config.cache.block_size - self.config.scheduler.num_lookahead_slots
        eos = () if params.ignore_eos else self.hf_config.eos_token_ids
        for seq in sequences(request_id, token_ids, params, self._arrival, eos_token_ids=tuple(eos),
                             max_model_len=min(self.max_model_len, capacity), arrival_time=arrival):
            self.scheduler.add_request(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort at any time; frees every block the request holds at once."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        return self._end(state, RequestStatus.FINISHED_ABORTED, "abort")

    def _end(self, state: RequestState, status: RequestStatus, finish_reason: str) -> RequestOutput:
        """End every sequence of a request still running (an abort, a failure); its last output."""
        metrics = request_metrics(state, self.scheduler)  # before the scheduler lets go of the sequences
        for seq in state.seqs:
            seq_id = sequence_id(state.request_id, state.params.n, seq.index)
            self.scheduler.finish_request(seq_id, status)
            if self._grammars is not None:
                self._grammars.remove(seq_id)
            self.outputs.finish(state, seq.index, status)
            self.counters.record_finished(seq.finish_reason)
        output = self.outputs.make_output(state)
        output.metrics = replace(metrics, finished_time=time.monotonic(), finish_reason=finish_reason)
        return output

    @property
    def grammars(self) -> RequestGrammars:
        """The matchers of requests with a StructuredSpec, over this model's tokenizer."""
        if self._grammars is None:
            self._grammars = RequestGrammars(
                GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, tuple(self.hf_config.eos_token_ids)),
                max_rollback_tokens=self.config.speculative.num_speculative_tokens)
        return self._grammars

    def compile_grammar(self, spec: StructuredSpec) -> None:
        """Compile `spec` now (thread-safe; AsyncEngine calls it off the step loop, so the step
        loop's own compile at add_request is a lookup). ValueError when it cannot compile."""
        self.grammars.compiler.compile(spec)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states) or bool(self._in_flight)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, finish the one in flight, then turn its tokens into outputs
        (text, stop strings) while the device runs the new one.

        When the step in flight left its sampled tokens on the device (plain greedy, or every
        pass of a multi-step step), the next one is scheduled on placeholders for them and
        launched *before* waiting for them, so the device never waits for the host's
        scheduling and input building. Otherwise the step in flight is collected first. With
        `overlap_steps` off (the default on CPU, where host and model share the cores) the step
        launched here also finishes within this call, so its outputs come back at once.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the replica group has failed: {self.dead_error}")
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        ahead = self._tokens_on_device()
        if ahead is not None:
            self._launch(ahead, self._in_flight[0][0].num_steps)
            done = self._collect()
        else:
            done = self._collect()
            if self.dead_error is None:
                self._launch()
        if self.dead_error is not None:
            return self._failed_outputs
        outputs = self._emit(done)
        if not self.overlap_steps:
            done = self._collect()
            if self.dead_error is not None:
                return outputs + self._failed_outputs
            outputs += self._emit(done)
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """With P pipeline stages: launch a step for every slot not in flight (each slot's
        requests are their own batch), then finish the oldest and turn its tokens into outputs.
        The workers run the steps in order, stage k the newer one while stage k + 1 the older,
        so every stage stays busy across steps where one step at a time would leave each idle
        (P-1)/P of it; and a slot's requests are never in two steps at once."""
        for _ in range(self.pipeline_depth):
            slot = self._next_slot
            if slot in self._slots_in_flight.values():
                break
            self._next_slot = (slot + 1) % self.pipeline_depth
            self._launch(slot=slot)
            if self.dead_error is not None:
                return self._failed_outputs
        done = self._collect()
        if self.dead_error is not None:
            return self._failed_outputs
        return self._emit(done)

    def _tokens_on_device(self) -> frozenset[str] | None:
        """Requests of the one step in flight whose sampled tokens (one a pass) are still on the
        device, when the next step may be scheduled on them (no drafts to propose, model in
        this process)."""
        if not self.overlap_steps or self.proposer is not None or len(self._in_flight) != 1 \
                or not self.model_in_process:
            return None
        return self._in_flight[0][1].on_device

    def _launch(self, ahead: frozenset[str] = frozenset(), num_ahead: int = 1, slot: int | None = None) -> None:
        if self.proposer is not None:
            # Draft tokens for running decodes when it pays; the scheduler reserves their slots.
            # A pipeline slot drafts for its own requests: the others' last tokens may be in flight.
            running = self.scheduler.running if slot is None else [
                r for r in self.scheduler.running if r.pp_slot == slot]
            candidates = self.spec_policy.candidates(running)
            if candidates:
                self.proposer.propose(candidates)
                self.spec_policy.stats.num_steps_with_drafts += 1
                if self._grammars:
                    self._grammars.trim_drafts(candidates)
        # EngineConfig allows several passes only with the model in this process and no drafts.
        sched_out = self.scheduler.schedule(ahead, self.max_passes(), num_ahead, slot, self.pipeline_depth)
        if not sched_out.has_work:
            return
        if self._grammars:
            self._attach_masks(sched_out, ahead)
        started = time.perf_counter()
        try:
            pending = self.executor.execute_async(sched_out)
        except Exception as exc:  # a worker died or raised: fail the group loudly
            self._failed_outputs = self.fail(f"{type(exc).__name__}: {exc}")
            return
        self._in_flight.append((sched_out, pending, started))
        if slot is not None:
            self._slots_in_flight[sched_out.step_id] = slot

    def _collect(self) -> list[StepUpdate]:
        """Wait for the oldest step in flight; the scheduler takes its tokens (token-level stops)."""
        if not self._in_flight:
            return []
        sched_out, pending, started = self._in_flight.popleft()
        self._slots_in_flight.pop(sched_out.step_id, None)
        try:
            result = pending.result()
        except Exception as exc:  # a worker died or raised: fail the group loudly
            self._failed_outputs = self.fail(f"{type(exc).__name__}: {exc}")
            return []
        done_at = time.perf_counter()
        seconds = done_at - started
        num_tokens = sched_out.total_num_scheduled_tokens
        self._last_step_s = done_at - max(started, self._last_done_at)
        if num_tokens == len(result.req_ids):  # decodes alone: the device's time a pass
            self._note_pass_time(self._last_step_s / sched_out.num_steps)
        self._last_done_at = done_at
        self._note_prefill_speed(num_tokens, len(sched_out.num_scheduled_tokens), seconds)
        passes = sched_out.num_steps
        self.counters.record_step(num_tokens * passes, sched_out.num_context_tokens, sched_out.num_attention_pairs,
                                  len(result.req_ids) * passes, seconds, num_passes=passes)
        if sched_out.spec_token_ids:
            for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
                drafts = sched_out.spec_token_ids.get(req_id)
                if drafts and tokens:
                    self.spec_policy.record(req_id, len(drafts), len(tokens) - 1)
        for req_id, (first, entries) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(req_id)
            state = self.states.get(req.parent_id) if req is not None and req.index == 0 else None
            if state is not None:
                self.outputs.add_prompt_logprobs(state, first, entries)
        updates = self.scheduler.update(sched_out, result)
        if self._grammars:
            self._advance_grammars(updates)
        return updates

    def _attach_masks(self, sched_out: SchedulerOutput, ahead: frozenset[str]) -> None:
        """The step's grammar masks; deferred when a grammar row was scheduled ahead of its last
        token: then the runner calls for them once this step's forward pass is launched, and
        they wait for the step in flight, advance the matchers over its tokens and are made
        while the device runs this step (the overlap holds for grammar rows too)."""
        grammars = self._grammars
        early = {seq for seq in sched_out.num_scheduled_tokens if seq in ahead and seq in grammars}
        if not early:
            sched_out.token_masks = grammars.masks(sched_out.num_scheduled_tokens, sched_out.spec_token_ids)
            return
        before = self._in_flight[0][1]  # the step whose tokens this one was scheduled on

        def masks() -> dict[str, Any]:
            result = before.result()
            for seq, tokens in zip(result.req_ids, result.sampled_token_ids):
                if seq in early:
                    grammars.accept_early(seq, tokens)
            return grammars.masks(sched_out.num_scheduled_tokens, sched_out.spec_token_ids)

        sched_out.token_masks = masks

    def _advance_grammars(self, updates: list[StepUpdate]) -> None:
        """Each grammar sequence's matcher takes the tokens the scheduler kept, before the next
        step's masks are made; a grammar that is complete ends its sequence (even with
        ignore_eos: nothing more can match)."""
        for update in updates:
            req = update.request
            if req.request_id not in self._grammars:
                continue
            if self._grammars.accept(req.request_id, update.new_token_ids) and not req.status.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.status.is_finished:
                self._grammars.remove(req.request_id)

    def _emit(self, updates: list[StepUpdate]) -> list[RequestOutput]:
        """Text, stop strings and outputs of a finished step's tokens."""
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        had_decode = False
        for update in updates:
            req = update.request
            state = self.states.get(req.parent_id)
            if state is None:
                continue
            if req.num_cached_prompt_tokens > state.num_cached_tokens:
                state.num_cached_tokens = req.num_cached_prompt_tokens
            if update.new_token_ids:
                if state.first_token_time:
                    had_decode = True
                else:
                    state.first_token_time = now
                state.last_token_time = now
            if self.outputs.add_tokens(state, req, update.new_token_ids, update.new_logprobs):
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.status.is_finished:
                if req.index == 0:
                    keep_leader_figures(state, req)
                drafted, accepted = self.spec_policy.forget(req.request_id)
                state.num_draft_tokens += drafted
                state.num_accepted_tokens += accepted
            touched[state.request_id] = state
        if updates:
            self.counters.record_emit(now, had_decode)
        outputs = []
        # A paced output is made at the step end nearest its time, not the first one after it:
        # with steps of several passes, "after" would hold a stream whose step ends just short of
        # its time for one more whole step, twice its pace.
        early_s = 0.5 * self._last_step_s
        for request_id, state in touched.items():
            if state.finished:
                del self.states[request_id]
                output = self.outputs.make_output(state)
                output.metrics = replace(request_metrics(state, self.scheduler), finished_time=now)
                for seq in state.seqs:
                    self.counters.record_finished(seq.finish_reason)
                outputs.append(output)
                continue
            if state.params.output_kind == "final":
                continue  # its one output comes when it finishes
            pace = state.pace
            if pace is not None and state.first_token_time:  # the first token is never held
                if now + early_s < state.next_output_time:
                    continue  # its tokens wait in its sequences: the next output says them
                state.next_output_time = now + pace.interval_s
            outputs.append(self.outputs.make_output(state))
        return outputs

    def max_passes(self) -> int:
        """Forward passes the next step may run: `num_scheduler_steps` at most, and no more than
        fit in the shortest pace of the paced streams running (workers/core/output_pace.py). A
        multi-step step hands its tokens over when it ends, so a stream paced one output per
        interval loses nothing to steps no longer than that interval: its tokens would wait in
        the engine for the pace anyway. A served stream always has a pace (its channel's, which
        is shorter than a step while it streams alone: then a step runs one pass). Requests
        without one (answered whole, or read by the engine's own caller) take every pass."""
        limit = self.config.scheduler.num_scheduler_steps
        if limit == 1:
            return 1
        pass_s = self.pass_s
        for state in self.states.values():
            pace = state.pace
            if pace is None:
                continue
            if pass_s is None:
                return 1  # no decode step measured yet
            limit = min(limit, int(pace.interval_s / pass_s))
            if limit <= 1:
                return 1
        return limit

    def _note_pass_time(self, seconds: float) -> None:
        self.pass_s = seconds if self.pass_s is None else 0.8 * self.pass_s + 0.2 * seconds

    def _note_prefill_speed(self, num_tokens: int, num_requests: int, seconds: float) -> None:
        """Prompt tokens per second of prefill-heavy steps (an EMA): prices recomputing a prefix."""
        if num_tokens >= 2 * max(1, num_requests) and seconds > 0:
            speed = num_tokens / seconds
            self.prefill_tokens_per_s = speed if self.prefill_tokens_per_s is None else (
                0.8 * self.prefill_tokens_per_s + 0.2 * speed)

    def give_up(self, error: str) -> list[RequestOutput]:
        """Fail the group from outside a step (a watchdog found a worker dead): the executor
        stops what is left of its workers, then every in-flight request ends as in `fail`."""
        self.executor.fail(error)
        return self.fail(error)

    def fail(self, error: str) -> list[RequestOutput]:
        """End every in-flight request with finish reason 'error'; refuse new ones."""
        logger.error("replica group failed: %s", error)
        self.dead_error = error
        self._in_flight.clear()
        self._slots_in_flight.clear()
        outputs = []
        for state in list(self.states.values()):
            state.error = error
            outputs.append(self._end(state, RequestStatus.FINISHED_ERROR, "error"))
        self.states.clear()
        return outputs

    @property
    def num_draft_tokens(self) -> int:
        return self.spec_policy.stats.num_draft_tokens

    @property
    def num_accepted_draft_tokens(self) -> int:
        return self.spec_policy.stats.num_accepted_tokens

    def probe_device_peaks(self) -> tuple[DevicePeaks, int] | None:
        """(peaks of one of the model's devices, how many devices the group has), measured with
        `tandem bench`'s probes; None where the model runs on Ray workers, or is simulated."""
        if not isinstance(self.executor, UniProcExecutor):
            return None
        runner = self.executor.runner
        return DevicePeaks.probe(runner.device, runner.dtype, quick=True), 1

    def metrics_snapshot(self) -> dict[str, float]:
        """Cumulative counters and current gauges for the server's metrics exporter; safe to call
        from another thread (see `exporter_figures`)."""
        return exporter_figures(self.scheduler, self.counters, self.spec_policy)

    def stats(self) -> dict[str, float]:
        return {**self.scheduler.stats(), **self.spec_policy.figures()}

    def worker_pids(self) -> list[int]:
        """The process ids of the group's Ray workers ([] with the model in this process)."""
        return self.executor.worker_pids()

    def _log_kv_cache(self) -> None:
        """One start-up line: the group's KV blocks, tokens, bytes and dtype (an FP8 cache: twice the tokens)."""
        import torch

        device = torch.device("cpu" if self.executor.device_type == "cpu" else "cuda")  # "sim" stands for a GPU
        dtype = kv_quant.cache_dtype(self.config.cache.kv_cache_dtype,
                                     self.hf_config.resolve_dtype(self.config.model.dtype, device))
        num = self.pool.num_blocks
        logger.info("KV cache: %d blocks, %d tokens, %.2f GB (%s)", num, num * self.config.cache.block_size,
                    num * self.executor.kv_bytes_per_block() / 1e9, str(dtype).removeprefix("torch."))

    # ---- the host KV tier ----------------------------------------------------------------------
    def enable_host_tier(self, num_bytes: int) -> int:
        """Keep evicted prefix blocks in `num_bytes` of host memory; returns the slots made."""
        num_slots = num_bytes // self.executor.kv_bytes_per_block()
        if num_slots < 1:
            raise ValueError(f"host_kv_cache_memory: {num_bytes} bytes hold no KV block "
                             f"({self.executor.kv_bytes_per_block()} bytes each)")
        self.executor.init_host_cache(num_slots)
        self.scheduler.kv.enable_host_tier(num_slots)
        return num_slots

    # ---- the server's view: block geometry, where the model runs -------------------------------
    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def num_kv_blocks(self) -> int:
        """The group's KV blocks on its devices."""
        return self.pool.num_blocks

    def kv_bytes_per_block(self) -> int:
        """One block's KV over the whole group (every rank's shard)."""
        return self.executor.kv_bytes_per_block()

    @property
    def model_in_process(self) -> bool:
        """The model runs in this process, not on Ray workers: the KV blocks it exports and
        imports are tensors here, where Ray workers would take object refs themselves. A simulated
        device is in this process too."""
        return isinstance(self.executor, (UniProcExecutor, SimulatedExecutor))

    # ---- the cluster allocator's view ----------------------------------------------------------
    def enable_block_events(self) -> None:
        """Record prefix-cache block events for `drain_block_events` (someone must drain them)."""
        self.pool.record_events = True

    def drain_block_events(self) -> list[tuple[str, int]]:
        return [(e.kind, e.block_hash) for e in self.pool.drain_events()]

    def cached_block_hashes(self) -> list[int]:
        """Every prefix block this group can serve from its cache (a re-registration snapshot)."""
        host = self.scheduler.kv.host
        return list(set(self.pool.cached_hashes()).union(host.hashes() if host is not None else ()))

    def usage(self) -> dict[str, Any]:
        """The figures the allocator keeps per group (for routing and admission)."""
        stats = self.scheduler.stats()
        return {key: stats[key] for key in ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free",
                                            "kv_blocks_cached", "kv_usage")}

    def shutdown(self) -> None:
        heap, self.startup_heap = self.startup_heap, None
        with heap.released() if heap is not None else nullcontext():
            if self.proposer is not None and hasattr(self.proposer, "shutdown"):
                self.proposer.shutdown()  # a shared draft: detach (the last group ends it)
            self.executor.shutdown()
