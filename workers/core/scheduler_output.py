"""The step message (engine -> workers) and step result (workers -> engine).

Small dataclasses of plain types. New requests travel in full once; requests the
workers already hold travel as diffs (new block ids, new token ids), so a step's
message stays small however long the sequences get.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.workers.core.request import PositionLogprobs, SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]  # output tokens the workers have not seen yet
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step
    num_kept_blocks: int  # the workers' table is cut to this length before appending new_block_ids


@dataclass(frozen=True)
class Park:
    """Executor -> workers while a replica group is idle: wait, off the CPU, until unparked
    (workers/executor/parking.py)."""


@dataclass
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # includes draft tokens
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # drop worker state for these
    # Host KV tier copies, applied before the forward in this order (see host_tier.py).
    host_saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    host_loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    # For the model cost figures (workers/core/stats.py): KV tokens the step attends to, and
    # (query, key) pairs; a request computing n tokens after c cached ones reads c + n and
    # attends n * c + n (n + 1) / 2.
    num_context_tokens: int = 0
    num_attention_pairs: int = 0
    # Multi-step decoding (SchedulerConfig.num_scheduler_steps): every request is a decode of one
    # token without penalties or logprobs, and the runner runs this many forward passes, each on
    # the tokens the one before sampled; each request gets this many tokens back. Its KV slots
    # are allocated.
    num_steps: int = 1
    # Structured outputs: per sequence with a grammar, [1 + drafts, words] int32 token bitmasks
    # (workers/structured/request_grammars.py); the sampling rank applies the rows it scores.
    # A step scheduled ahead of its grammar rows' last tokens carries a function instead (the
    # model in this process only): the runner calls it once the forward pass is launched, and
    # it waits for those tokens, advances the matchers and makes the masks while the device runs.
    token_masks: dict[str, Any] | Callable[[], dict[str, Any]] = field(default_factory=dict)

    def resolved_token_masks(self) -> dict[str, Any]:
        """The masks, made now if they were deferred (once: the function advances matchers)."""
        if callable(self.token_masks):
            self.token_masks = self.token_masks()
        return self.token_masks

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens of the first forward pass (a multi-step step runs `num_steps` of them)."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def has_work(self) -> bool:
        """Anything for the workers at all: tokens, state to drop, or KV copies."""
        return bool(self.num_scheduled_tokens or self.finished_req_ids or self.host_saves or self.host_loads)


@dataclass
class RunnerOutput:
    req_ids: list[str]
    # Per request: the tokens this step produced. [] for a partial prefill chunk; one
    # token normally; up to 1 + len(draft) when draft tokens were verified.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[PositionLogprobs] | None]
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # req_id -> (prompt index of the first entry, logprobs of prompt tokens from there on)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)


class PendingOutput:
    """A step's RunnerOutput, possibly still being computed: `result()` waits for it (for an
    event the device records after copying the sampled tokens out, or a Ray future)."""

    def __init__(self, finish: Callable[[], RunnerOutput], event: Any = None) -> None:
        self._finish = finish
        self._event = event
        self._output: RunnerOutput | None = None
        self._callbacks: list[Callable[[RunnerOutput], None]] = []
        # Requests whose sampled token is still on the device, where the next step may read it
        # (workers/runner/model_runner.py); None when the tokens are host-side only.
        self.on_device: frozenset[str] | None = None
        self.device_tokens: Any = None  # the sampled token ids as a tensor, one per scored row

    @staticmethod
    def done(output: RunnerOutput) -> PendingOutput:
        return PendingOutput(lambda: output)

    def then(self, callback: Callable[[RunnerOutput], None]) -> None:
        """Run `callback` on the output once it is made (at once if it is)."""
        if self._output is not None:
            callback(self._output)
        else:
            self._callbacks.append(callback)

    def result(self) -> RunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            self._output = self._finish()
            for callback in self._callbacks:
                callback(self._output)
        return self._output
