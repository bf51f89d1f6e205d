"""Request, SamplingParams and RequestOutput, in the shapes vLLM users know."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.workers.config import require_field
from tandem.workers.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from tandem.workers.core.stats import RequestMetrics


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# A temperature this small scales float32 logits past their range (1e-40 makes them inf and
# the softmax NaN): below it a request is greedy, which is what such a temperature means (vLLM's
# threshold too).
GREEDY_BELOW_TEMPERATURE = 1e-5
# Repetition penalties divide or multiply seen tokens' logits: beyond these, they overflow
# float32 just as a tiny temperature does (and no one means a 1e30-fold penalty).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries


@dataclass
class SamplingParams:
    """How to sample one request. Validated at construction; errors name the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the chosen token
    prompt_logprobs: int | None = None  # the same for every prompt token (computes the whole prompt)
    skip_special_tokens: bool = True
    # cumulative | delta (streaming) | final (one output, when finished: no text is decoded
    # until then unless a stop string needs it; what LLM.generate asks for)
    output_kind: str = "cumulative"
    use_speculation: bool = True  # per-request opt-out of speculative decoding
    # What the output must match (a JSON schema, a regex, choices, a grammar): enforced while
    # decoding, each step's logits masked to the tokens the grammar allows (workers/structured/).
    structured: StructuredSpec | None = None
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        for name in _FLOAT_FIELDS:  # NaN and the infinities mean nothing here (protobuf can carry them)
            value = getattr(self, name)
            require_field(isinstance(value, (int, float)) and math.isfinite(value), name,
                          f"must be a finite number, got {value!r}")
        require_field(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        require_field(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        require_field(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        require_field(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                 f"must be -1 (off) or >= 1, got {self.top_k!r}")
        require_field(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        require_field(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty}")
        require_field(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty}")
        low, high = REPETITION_PENALTY_RANGE
        require_field(low <= self.repetition_penalty <= high, "repetition_penalty",
                      f"must be in [{low}, {high:g}], got {self.repetition_penalty}")
        if 0.0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        if self.max_tokens is not None:
            require_field(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                     f"must be an integer >= 1, got {self.max_tokens!r}")
        require_field(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
                 f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            require_field(self.min_tokens <= self.max_tokens, "min_tokens",
                     f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            require_field(isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20, "logprobs",
                     f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            require_field(isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20,
                          "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        require_field(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        require_field(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be non-negative integers")
        if self.logit_bias is not None:
            require_field(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                          f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for token, bias in self.logit_bias.items():
                require_field(isinstance(token, int) and not isinstance(token, bool) and token >= 0, "logit_bias",
                              f"keys must be token ids (integers >= 0), got {token!r}")
                require_field(isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100,
                              "logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token {token}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        require_field(self.structured is None or isinstance(self.structured, StructuredSpec), "structured",
                      f"must be a StructuredSpec, got {type(self.structured).__name__}")
        require_field(self.output_kind in ("cumulative", "delta", "final"), "output_kind",
                      f"must be 'cumulative', 'delta' or 'final', got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """A grammar or a logit bias changes the logits before sampling (the host sampler's work)."""
        return self.structured is not None or self.logit_bias is not None

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        # _value_, not value: the latter goes through Enum's descriptor, and this is asked
        # for every request every step.
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(("stop", "length", "abort", "error"))


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: the chosen token plus the top-N alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class Request:
    """One sequence as the scheduler sees it (an `n > 1` prompt becomes n of these).

    Slotted: the scheduler, the runner's diff and the outputs read a handful of its fields for
    every running request every step, and a slot is one read of the object where an instance
    dict is a hash lookup in a table of its own (more memory touched a request a step)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_seq: int  # strictly increasing; preemption picks the largest
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    parent_id: str | None = None  # the user-visible request id for n > 1
    index: int = 0  # which of the n completions this is
    leader_id: str | None = None  # sibling whose prompt KV this one waits to share

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify this step
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of full blocks so far
    num_published_blocks: int = 0  # leading blocks published to the prefix cache (KVCacheManager)
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    # Monitoring (workers/core/stats.py): monotonic seconds; 0.0 = not yet.
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    num_prefill_chunks: int = 0  # steps that computed part of the prompt
    # How many of the last output tokens are PENDING_TOKENs: sampled by a step still on the
    # device (one a pass), and already scheduled into the next one (Scheduler.schedule(ahead=...)).
    num_pending: int = 0
    # Which of the pipeline's in-flight step slots it runs in (Scheduler.schedule(slot=...)).
    pp_slot: int = 0
    error: str | None = None
    # Fixed at creation (__post_init__): prompt plus the most output tokens it may produce, the
    # most output tokens, and the ids that end it once it has min_tokens (its stop ids, and
    # EOS unless ignore_eos).
    max_total_tokens: int = field(init=False)
    max_output_tokens: int = field(init=False)
    ending_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, len(self.prompt_token_ids) + params.max_tokens)
        self.max_total_tokens = limit
        self.max_output_tokens = limit - len(self.prompt_token_ids)
        self.ending_token_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int) -> list[int]:
        """all_token_ids[start:] without copying the whole sequence (a step sends a token or two)."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, self.num_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def token_at(self, position: int) -> int:
        return token_at(self.prompt_token_ids, self.output_token_ids, position)


def token_at(prompt: list[int], outputs: list[int], position: int) -> int:
    """Token `position` of prompt + outputs, without concatenating them."""
    num_prompt = len(prompt)
    return prompt[position] if position < num_prompt else outputs[position - num_prompt]


def token_slice(prompt: list[int], outputs: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + outputs, without concatenating them."""
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return outputs[start - num_prompt:end - num_prompt]
    return prompt[start:] + outputs[:end - num_prompt]


# Stands for a token that a step in flight has sampled and the host has not seen yet; the
# model runner feeds the step's device-side token in its place (workers/runner/step_inputs.py).
PENDING_TOKEN = -1


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def join_outputs(parts: Iterable[list[CompletionOutput]]) -> list[CompletionOutput]:
    """The sequences' news of consecutive deltas as one, in one pass: per sequence index its
    texts, token ids and logprobs joined in order, and the latest finish reason."""
    joiner = OutputJoiner()
    for outputs in parts:
        joiner.add(outputs)
    return joiner.result()


class OutputJoiner:
    """`join_outputs`, one delta's outputs at a time: what it holds between deltas is a few
    lists per sequence (texts, token ids), not the deltas themselves, so deltas waiting to be
    joined cost the garbage collector nothing to walk."""

    __slots__ = ("_joined",)

    def __init__(self) -> None:
        self._joined: dict[int, tuple[list[str], list[int], list[PositionLogprobs] | None, CompletionOutput]] = {}

    def add(self, outputs: list[CompletionOutput]) -> None:
        joined = self._joined
        for o in outputs:
            part = joined.get(o.index)
            if part is None:
                joined[o.index] = ([o.text], list(o.token_ids), None if o.logprobs is None else list(o.logprobs), o)
                continue
            texts, token_ids, logprobs, _ = part
            texts.append(o.text)
            token_ids.extend(o.token_ids)
            if o.logprobs is not None:
                if logprobs is None:
                    logprobs = list(o.logprobs)
                else:
                    logprobs.extend(o.logprobs)
            joined[o.index] = (texts, token_ids, logprobs, o)

    def result(self) -> list[CompletionOutput]:
        # Built field by field, not with dataclasses.replace (which walks the fields each time):
        # this runs for every streamed message of every request.
        return [CompletionOutput(o.index, "".join(texts), token_ids, logprobs, o.finish_reason, o.stop_reason,
                                 o.cumulative_logprob)
                for texts, token_ids, logprobs, o in (self._joined[i] for i in sorted(self._joined))]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    # With params.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it). In delta mode it comes once, with the first output that has it complete.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # On the last output of a request: its timeline and counts (workers/core/stats.py).
    metrics: RequestMetrics | None = None
