"""The request sets of `tandem bench prefix`: prompts that share long prefixes, prompts that
share nothing, and (cold, hit) pairs of one prefix; sized by `PrefixBenchConfig`."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from tandem.bench.workload import NUM_SPECIAL_TOKENS, BenchRequest

POLICIES = ("prefix", "load")  # the values of build_app's `routing` option
LABELS = {"prefix": "routed", "load": "load_only"}  # in figure names
NO_PREFIX = -1  # prefix id of a request that shares nothing


@dataclass(frozen=True)
class PrefixBenchConfig:
    num_prefixes: int = 4
    prefix_len: int = 900
    suffix_len: int = 100
    output_len: int = 8
    num_requests: int = 48  # shared workload, per run
    num_no_share: int = 12  # no-share workload, per run
    request_rate: float = 0.8  # shared workload, req/s (Poisson)
    num_groups: int = 2
    cache_requests: float | None = None  # per group KV cache, in whole requests; None = K/2 + 0.5
    repeats: int = 3
    num_hit_pairs: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefixes", "prefix_len", "suffix_len", "output_len", "num_requests", "num_no_share",
                     "num_groups", "repeats", "num_hit_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0, got {self.request_rate}")
        if self.cache_requests is not None and self.cache_requests < 1:
            raise ValueError(f"cache_requests: must be >= 1 (room for one request), got {self.cache_requests}")

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    @property
    def cache_tokens(self) -> int:
        """KV cache tokens per group."""
        per_group = self.cache_requests if self.cache_requests is not None else self.num_prefixes / 2 + 0.5
        return math.ceil(per_group * (self.prompt_len + self.output_len))


PREFIX_FULL = PrefixBenchConfig()
PREFIX_QUICK = PrefixBenchConfig(num_requests=24, num_no_share=8, repeats=2, num_hit_pairs=3)


# ---- workloads --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixWorkload:
    requests: list[BenchRequest]
    prefix_ids: list[int]  # per request: index into `prefixes`, or NO_PREFIX
    prefixes: list[list[int]] = field(default_factory=list)
    warmup: list[BenchRequest] = field(default_factory=list)  # one request per prefix, not measured


def _tokens(rng: random.Random, num: int, vocab_size: int) -> list[int]:
    return [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(num)]


def shared_workload(cfg: PrefixBenchConfig, vocab_size: int, seed: int) -> PrefixWorkload:
    """`cfg.num_requests` requests over `cfg.num_prefixes` prefixes, each used equally often (+-1)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, cfg.prefix_len, vocab_size) for _ in range(cfg.num_prefixes)]
    prefix_ids = [i % cfg.num_prefixes for i in range(cfg.num_requests)]
    rng.shuffle(prefix_ids)
    requests = [BenchRequest(prefixes[p] + _tokens(rng, cfg.suffix_len, vocab_size), cfg.output_len)
                for p in prefix_ids]
    warmup = [BenchRequest(p + _tokens(rng, cfg.suffix_len, vocab_size), cfg.output_len) for p in prefixes]
    return PrefixWorkload(requests, prefix_ids, prefixes, warmup)


def no_share_workload(cfg: PrefixBenchConfig, vocab_size: int, seed: int) -> PrefixWorkload:
    rng = random.Random(seed)
    requests = [BenchRequest(_tokens(rng, cfg.prompt_len, vocab_size), cfg.output_len)
                for _ in range(cfg.num_no_share)]
    return PrefixWorkload(requests, [NO_PREFIX] * len(requests))


def hit_pairs(cfg: PrefixBenchConfig, vocab_size: int, seed: int) -> list[tuple[BenchRequest, BenchRequest]]:
    """(cold, hit): two requests of one fresh prefix, different suffixes."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(cfg.num_hit_pairs):
        prefix = _tokens(rng, cfg.prefix_len, vocab_size)
        cold, hit = (BenchRequest(prefix + _tokens(rng, cfg.suffix_len, vocab_size), cfg.output_len)
                     for _ in range(2))
        pairs.append((cold, hit))
    return pairs
