"""The seeded request set every system in a benchmark runs: random prompts, fixed output lengths.

Prompts are random token ids (the benchmark models have random weights, so text would buy
nothing) drawn above the special-token range; lengths are uniform in the spec's ranges.
Output lengths are exact: every system is told to ignore EOS and stop at the requested length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUM_SPECIAL_TOKENS = 5  # demo_model.SPECIAL_TOKENS take ids 0..4; prompts avoid them


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range, uniform
    output_len: tuple[int, int]  # inclusive range, uniform
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.num_requests >= 1, "num_requests must be >= 1"
        for lo, hi in (self.prompt_len, self.output_len):
            assert 1 <= lo <= hi, f"bad length range [{lo}, {hi}]"


# The request set, and the same shape at a quarter of the lengths for --quick.
OFFLINE_FULL = WorkloadSpec(num_requests=64, prompt_len=(32, 512), output_len=(32, 256))
OFFLINE_QUICK = WorkloadSpec(num_requests=32, prompt_len=(8, 128), output_len=(8, 64))


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The same list for the same spec and vocabulary, on every machine."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_len)
        output_len = rng.randint(*spec.output_len)
        prompt = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, output_len))
    return requests


def fixed_length_requests(num: int, prompt_len: int, output_len: int, vocab_size: int,
                          seed: int = 0) -> list[BenchRequest]:
    """`num` requests of one shape (latency runs and the batch sweep)."""
    return make_workload(WorkloadSpec(num, (prompt_len, prompt_len), (output_len, output_len), seed), vocab_size)


def num_prompt_tokens(requests: list[BenchRequest]) -> int:
    return sum(len(r.prompt_token_ids) for r in requests)


def num_output_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.output_len for r in requests)
