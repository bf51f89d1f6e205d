"""What the engine counts for monitoring: plain numbers, cheap to keep, read by the server.

The engine keeps cumulative counters and a request's timestamps (on the objects the request
already has); nothing here allocates per request per step. The server (workers/serving/group_metrics.py)
reads the counters about once a second and turns them into Prometheus metrics; each
finished request's `RequestMetrics` rides on its last `RequestOutput`.

Timestamps are `time.monotonic()` seconds (intervals); `wall_time` converts one to the
wall clock for trace spans.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

# At most this many step intervals wait for the exporter (about 10 s of steps at 1 ms each):
# with nobody reading, the oldest are dropped, never piled up.
MAX_PENDING_INTERVALS = 10_000


def wall_time(monotonic_s: float) -> float:
    """A `time.monotonic()` reading as wall-clock seconds since the epoch."""
    return time.time() - (time.monotonic() - monotonic_s)


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request's timeline (monotonic seconds; 0.0 = never happened) and counts.

        arrival ──queue──> first scheduled ──prefill──> first token ──decode──> finished
    """

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    last_token_time: float
    finished_time: float
    finish_reason: str  # of the first sequence: stop | length | abort | error
    num_prompt_tokens: int
    num_generation_tokens: int  # over every sequence (n > 1)
    num_cached_tokens: int
    num_prefill_chunks: int  # steps that computed part of the prompt (first sequence)
    num_preemptions: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_s(self) -> float | None:
        return self.first_scheduled_time - self.arrival_time if self.first_scheduled_time else None

    @property
    def prefill_s(self) -> float | None:
        if not (self.first_scheduled_time and self.first_token_time):
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_time - self.arrival_time if self.first_token_time else None

    @property
    def decode_s(self) -> float | None:
        return self.last_token_time - self.first_token_time if self.first_token_time else None

    @property
    def e2e_s(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two)."""
        num_seqs_tokens = self.num_generation_tokens
        if not self.first_token_time or num_seqs_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_seqs_tokens - 1)


class StepCost(Protocol):
    """A step's model bytes and FLOPs (workers/model/cost.py's ModelCost)."""

    def step_bytes(self, num_context_tokens: int, num_passes: int = 1) -> int: ...

    def step_flops(self, num_tokens: int, num_attention_pairs: int, num_logit_rows: int) -> int: ...


@dataclass
class EngineStats:
    """Cumulative figures of one engine (the scheduler keeps its own token counters)."""

    cost: StepCost | None = None  # None: no MBU / MFU figures
    num_finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    num_steps: int = 0
    step_seconds: float = 0.0  # sum of launch-to-collect times
    bytes_read: float = 0.0  # model bytes (weights + KV) the steps read
    flops: float = 0.0  # model FLOPs of the steps
    # Time between two consecutive emits that both gave a running request a token: the
    # inter-token latency of every request decoding through them. Drained by the exporter.
    token_intervals: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_INTERVALS))
    _last_emit: float = 0.0

    def record_step(self, num_tokens: int, num_context_tokens: int, num_attention_pairs: int,
                    num_logit_rows: int, seconds: float, num_passes: int = 1) -> None:
        """A step's totals over its forward passes (several in multi-step decoding)."""
        self.num_steps += 1
        self.step_seconds += seconds
        if self.cost is not None:
            self.bytes_read += self.cost.step_bytes(num_context_tokens, num_passes)
            self.flops += self.cost.step_flops(num_tokens, num_attention_pairs, num_logit_rows)

    def record_emit(self, now: float, had_decode: bool) -> None:
        if had_decode and self._last_emit:
            self.token_intervals.append(now - self._last_emit)
        self._last_emit = now

    def record_finished(self, reason: str | None) -> None:
        if reason is not None:
            self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def drain_token_intervals(self) -> list[float]:
        """The intervals recorded since the last drain (safe from another thread)."""
        out = []
        intervals = self.token_intervals
        while intervals:
            try:
                out.append(intervals.popleft())
            except IndexError:
                break
        return out
