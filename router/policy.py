"""Which replica group should take the next request: pure scoring, no Serve.

A group reports its load (`GroupServer.record_routing_stats`, polled every second or
so); the router adds what it knows that is fresher, the requests it has sent a group
and not yet seen finish. Lower scores are better:

    score = outstanding + waiting_weight * num_waiting + kv_weight * kv_usage
    outstanding = max(num_running + num_waiting - num_done_since_poll, num_in_flight)

`max`, not a sum: the reported figures already include the router's own requests as
of the last poll; the in-flight count covers those sent since. The reported figures
are up to a poll period old: the requests this router saw finish on the group since
then (`num_done_since_poll`) are taken off them, or a burst that just ended would keep
steering requests away from its group for up to a second. Queued requests cost
extra (they wait for a seat), and a fuller KV cache means preemption sooner. A group
that says it is unhealthy scores infinity and is tried last.

Prefix-cache-aware routing (`score_prefix`) subtracts a credit for the prompt tokens a
group already holds, priced in the same unit (outstanding requests):

    score = load - cached_tokens / tokens_per_request     if load <= min_load + max_imbalance
    score = load                                          otherwise

`tokens_per_request`: how many prompt tokens a group can skip recomputing for the
saving to be worth one more request in its queue (a prefill of that many tokens costs
about one decode slot's share of a step budget). So a 900-token hit outweighs a queue
a few requests longer, a 16-token hit hardly counts. `max_imbalance` bounds what a hot
prefix can do: a group more than that many outstanding requests above the least loaded
one gets no credit, so its prefix's requests spill to the others (which then cache it
too) instead of piling onto one group.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from tandem.workers.serving.messages import RoutingStats


@dataclass(frozen=True)
class LoadWeights:
    waiting: float = 1.0  # a queued request costs this much more than a running one
    kv_usage: float = 4.0  # a full KV cache costs as much as this many requests

    def __post_init__(self) -> None:
        if self.waiting < 0 or self.kv_usage < 0:
            raise ValueError(f"weights: must be >= 0, got {self}")


def score_load(stats: RoutingStats, num_in_flight: int = 0, weights: LoadWeights = LoadWeights(),
               num_done_since_poll: int = 0) -> float:
    """Outstanding work of one group (`RoutingStats()` before its first poll)."""
    if not stats.is_healthy:
        return math.inf
    reported = stats.num_running + stats.num_waiting
    waiting = max(0, stats.num_waiting - num_done_since_poll)  # the finished made room
    outstanding = max(reported - num_done_since_poll, num_in_flight, 0)
    return outstanding + weights.waiting * waiting + weights.kv_usage * stats.kv_usage


@dataclass(frozen=True)
class PrefixWeights:
    tokens_per_request: float = 256.0  # cached prompt tokens worth one outstanding request
    max_imbalance: float = 4.0  # outstanding requests above the least loaded group: no credit

    def __post_init__(self) -> None:
        if self.tokens_per_request <= 0 or self.max_imbalance < 0:
            raise ValueError(f"prefix weights: tokens_per_request must be > 0 and max_imbalance >= 0, got {self}")


def score_prefix(loads: Mapping[Hashable, float], cached_tokens: Mapping[Hashable, int],
                 weights: PrefixWeights = PrefixWeights()) -> dict[Hashable, float]:
    """Each group's load minus its prefix credit (see the module docstring); lower is better."""
    finite = [load for load in loads.values() if load != math.inf]
    if not finite:
        return dict(loads)
    bound = min(finite) + weights.max_imbalance
    return {g: load - cached_tokens.get(g, 0) / weights.tokens_per_request if load <= bound else load
            for g, load in loads.items()}


def rank_by_score(scores: Mapping[Hashable, float]) -> list[list[Hashable]]:
    """Tiers of equal score, best first (Serve picks the shortest queue within a tier)."""
    tiers: dict[float, list[Hashable]] = {}
    for key, score in scores.items():
        tiers.setdefault(score, []).append(key)
    return [tiers[s] for s in sorted(tiers)]


class CompletionLog:
    """When this router saw requests finish, per group: to age a group's polled load."""

    def __init__(self, keep_s: float = 30.0) -> None:
        self.keep_s = keep_s
        self._times: dict[Hashable, list[float]] = {}

    def record(self, group: Hashable, at: float) -> None:
        times = self._times.setdefault(group, [])
        times.append(at)
        if times[0] < at - self.keep_s:
            self._times[group] = [t for t in times if t >= at - self.keep_s]

    def since(self, group: Hashable, at: float | None) -> int:
        """Completions after `at` (a poll's time); 0 when the poll's time is unknown."""
        if at is None:
            return 0
        return sum(1 for t in self._times.get(group, ()) if t > at)

    def forget(self, group: Hashable) -> None:
        self._times.pop(group, None)
