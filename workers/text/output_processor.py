"""From sampled token ids to what users see: text, logprobs, finish reasons.

One RequestState per user request; an `n > 1` request has n sequences, each its
own scheduler Request and its own incremental detokenizer. Stop strings are found
here (they need text) and reported back so the scheduler frees the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import (
    CompletionOutput,
    PositionLogprobs,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from tandem.workers.text.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)  # read for every request every step: slots, not an instance dict each
class SequenceState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0  # delta mode: tokens already streamed


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # delta mode: they go out once
    # Delta mode, paced (workers/core/output_pace.py): no output before this monotonic time
    # once the first token went, but the last.
    pace: OutputPace | None = None
    next_output_time: float = 0.0
    # Monitoring (workers/core/stats.py): monotonic seconds; 0.0 = not yet.
    arrival_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    first_scheduled_time: float = 0.0  # these three: the first sequence's, kept when it finishes
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(...): asked for every request every step
            if seq.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  params: SamplingParams) -> RequestState:
        seqs = [SequenceState(i, IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens), logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None) for i in range(params.n)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, seqs)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # nothing predicts the first prompt token
        return state

    def add_prompt_logprobs(self, state: RequestState, first: int, entries: list[PositionLogprobs]) -> None:
        """Record the prompt logprobs one step scored; positions seen before (a recompute
        after preemption) are skipped."""
        if state.prompt_logprobs is None:
            return
        detok = state.seqs[0].detok
        for position, entry in enumerate(entries, start=first):
            if position != len(state.prompt_logprobs):
                continue
            for token_id, lp in entry.items():
                lp.decoded_token = detok.decode_token(token_id)
            state.prompt_logprobs.append(entry)

    def add_tokens(self, state: RequestState, req: Request, new_token_ids: list[int],
                   new_logprobs: list[PositionLogprobs] | None) -> bool:
        """Record a step's tokens for one sequence; returns True if a stop string ended it."""
        seq = state.seqs[req.index]
        seq.token_ids.extend(new_token_ids)
        if seq.logprobs is not None and new_logprobs:
            for token, lp in zip(new_token_ids, new_logprobs):
                for token_id, entry in lp.items():
                    entry.decoded_token = seq.detok.decode_token(token_id)
                seq.logprobs.append(lp)
                seq.cumulative_logprob += lp[token].logprob
        finished = req.status.is_finished
        if state.params.output_kind == "final" and not state.params.stop:
            seq.detok.add_tokens_unread(new_token_ids)  # decoded once, at the end
            if finished:
                self.finish(state, req.index, req.status, req)
            return False
        stop = seq.detok.add_tokens(new_token_ids)
        if stop is None and finished:
            stop = seq.detok.finish()
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
            return True
        if finished:
            self.finish(state, req.index, req.status, req)
        return False

    def finish(self, state: RequestState, index: int, status: RequestStatus, req: Request | None = None) -> None:
        seq = state.seqs[index]
        if seq.finish_reason is not None:
            return
        seq.detok.finish()
        seq.finish_reason = status.value
        if status == RequestStatus.FINISHED_STOPPED and seq.token_ids:
            seq.stop_reason = seq.token_ids[-1] if req is None or \
                seq.token_ids[-1] in req.sampling_params.stop_token_ids else None

    def make_output(self, state: RequestState) -> RequestOutput:
        delta = state.params.output_kind == "delta"
        outputs = []
        for seq in state.seqs:
            finished = seq.finish_reason is not None
            if delta:
                start = seq.num_tokens_sent
                seq.num_tokens_sent = len(seq.token_ids)
                text = seq.detok.stream_delta(finished)
                token_ids = seq.token_ids[start:]
                logprobs = seq.logprobs[start:] if seq.logprobs is not None else None
            else:
                text, token_ids, logprobs = seq.detok.output_text, list(seq.token_ids), seq.logprobs
            outputs.append(CompletionOutput(seq.index, text, token_ids, logprobs, seq.finish_reason,
                                            seq.stop_reason, seq.cumulative_logprob))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and len(state.prompt_logprobs) == len(state.prompt_token_ids):
            if not (delta and state.prompt_logprobs_sent):
                prompt_logprobs = state.prompt_logprobs
                state.prompt_logprobs_sent = True
        # Positional: made for every request every step, and a keyword call costs twice as much.
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, state.finished,
                             state.num_cached_tokens, state.error, prompt_logprobs)
