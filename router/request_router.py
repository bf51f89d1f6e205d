"""LoadAwareRouter: the Serve request router between replica groups.

Serve calls `choose_replicas` for each request with the running groups; each carries
the stats its `record_routing_stats` last returned (polled about once a second).
Scoring is `policy.py`'s; this class adds what it knows that is fresher: the requests
it has sent each group and not yet seen finish. With `routing="prefix"` it also asks
the cluster prefix directory (through `PrefixLookup`) how much of the prompt each
group holds, and scores with `score_prefix`; the directory never holds a request up
longer than the lookup's timeout, and when it is down routing is by load alone.

A burst arrives faster than Serve reports sends back (`on_request_routed` comes after
the group accepted), so each pick counts at once as a *predicted* request of the group
ranked first (Serve takes the first tier unless that group is full). A prediction
belongs to its pending request: a second pick for it (a retry after a rejection)
replaces it, and Serve's confirmation of that request takes it back, wherever the
request went, and counts the request on the group that took it; one never confirmed
lapses after a few seconds. The prompt's prefix is recorded on the group that took it,
not the one ranked first. With one group there is nothing to choose: no directory
lookup. Groups of equal score are tried in random order.

The router runs in each caller's process (the ingress's), and publishes the groups it knows
there (router/known_groups.py): while that is one group, the ingress sends streamed requests on its
channel to it instead of through Serve (router/group_channels.py).

NOTE: every group call made while serving one HTTP request (one per prompt of a
multi-prompt completion) carries that request's `internal_request_id`. Serve's default
matching of a chosen replica to a pending request is by that id, which would leave all
but one of them waiting forever; FIFOMixin matches in arrival order instead. For the
same reason routed requests are counted per id (a multiset), not kept in a set.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tandem.router import tracing
from tandem.router.policy import CompletionLog, LoadWeights, PrefixWeights, rank_by_score, score_load, score_prefix
from tandem.router.prefix_lookup import PrefixLookup, allocator_matcher
from tandem.workers.serving.group_metrics import start_at_zero
from tandem.workers.serving.messages import GroupRequest, RoutingStats

PREDICTION_TTL_S = 5.0


@dataclass(frozen=True)
class _Prediction:
    request: PendingRequest  # held, so that its id() is not reused while it is predicted
    group: ReplicaID  # ranked first for it
    made_at: float  # monotonic
    block_hashes: list[int]  # its prompt's, under prefix routing ([] otherwise)


class LoadAwareRouter(FIFOMixin, RequestRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weights = LoadWeights()
        self.prefix_weights = PrefixWeights()
        self.prefix: PrefixLookup | None = None
        self.num_prefix_routed = 0  # requests whose group a prefix credit decided
        self._routed: dict[ReplicaID, Counter[str]] = {}  # sent and accepted, not completed
        self._predicted: dict[int, _Prediction] = {}  # id(pending request) -> its pick, not confirmed yet
        self.completions = CompletionLog()  # seen to finish: ages each group's polled load
        self._decisions: Any = None  # the router-decision counter (ray.util.metrics), made on first use
        self.export_metrics = True

    def initialize_state(self, **kwargs: Any) -> None:
        """`request_router_kwargs`: `routing` ("prefix" | "load"), `block_size`, `metrics`
        (False: no router-decision counter), and the PrefixWeights and LoadWeights fields."""
        routing = kwargs.pop("routing", "load")
        self.export_metrics = kwargs.pop("metrics", True)
        block_size = kwargs.pop("block_size", 16)
        self.prefix_weights = PrefixWeights(**{k: kwargs.pop(k) for k in ("tokens_per_request", "max_imbalance")
                                               if k in kwargs})
        self.weights = LoadWeights(**kwargs)
        if routing == "prefix":
            self.prefix = PrefixLookup(block_size, allocator_matcher(self._deployment_id.app_name))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish(frozenset(r.replica_id.unique_id for r in replicas))

    def _publish(self, groups: frozenset[str]) -> None:
        from tandem.router import known_groups  # imported, not a global: see known_groups.py

        known_groups.publish(self._deployment_id.app_name, self._deployment_id.name, groups)

    def num_in_flight(self) -> Counter[ReplicaID]:
        """Requests each group has, as this router knows: sent and not seen finish, and
        predicted (picked for it, not confirmed yet; a prediction past its TTL lapses)."""
        horizon = time.monotonic() - PREDICTION_TTL_S
        for key in [k for k, p in self._predicted.items() if p.made_at < horizon]:
            del self._predicted[key]
        counts = Counter(p.group for p in self._predicted.values())
        for replica_id, routed in self._routed.items():
            counts[replica_id] += sum(routed.values())
        return counts

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        target = _request_field(pending_request, "target_group")
        if target is not None:  # a call meant for one group (a KV export, its stats)
            chosen = [r for rid, r in by_id.items() if rid.unique_id == target]
            return [chosen] if chosen else [list(by_id.values())]
        started_ns = time.time_ns()
        hashes = self._prompt_hashes(pending_request) if len(by_id) > 1 else []
        # The directory first: loads are read after the await, so requests routed
        # meanwhile (counted as predictions) are in them.
        held = await self.prefix.cached_tokens(hashes) if hashes else {}
        if pending_request is not None:  # chosen again (after a rejection): its own pick is no load
            self._predicted.pop(id(pending_request), None)
        in_flight = self.num_in_flight()
        scores = {}
        for rid, replica in by_id.items():
            stats = RoutingStats.from_dict(replica.routing_stats)
            scores[rid] = score_load(stats, in_flight[rid], self.weights,
                                     self.completions.since(rid, stats.stats_time))
        by_prefix = False
        if hashes:
            by_group = {rid: held.get(rid.unique_id, 0) for rid in by_id}
            load_best = min(scores, key=scores.get)
            scores = score_prefix(scores, by_group, self.prefix_weights)
            if min(scores, key=scores.get) != load_best:
                self.num_prefix_routed += 1
                by_prefix = True
        ranked = [rid for tier in rank_by_score(scores) for rid in random.sample(tier, len(tier))]
        avoid = _request_field(pending_request, "avoid_group")
        if avoid is not None:  # a retry: the group that failed it goes last (it may be the only one)
            ranked.sort(key=lambda rid: rid.unique_id == avoid)
        if pending_request is not None:
            self._predicted[id(pending_request)] = _Prediction(pending_request, ranked[0], time.monotonic(), hashes)
        if pending_request is not None and pending_request.metadata.call_method == "generate":
            self._record_decision(pending_request, ranked[0], by_prefix, held, scores, started_ns)
        return [[by_id[rid]] for rid in ranked]

    def _record_decision(self, pending_request: PendingRequest, chosen: ReplicaID, by_prefix: bool,
                         held: dict[str, int], scores: dict[ReplicaID, float], started_ns: int) -> None:
        """Count the decision (prefix hit vs load) and record it on the request's trace."""
        decision = "prefix" if by_prefix else "load"
        if self._decisions is None and self.export_metrics:
            self._decisions = decisions_counter(self._deployment_id.app_name)
        if self._decisions is not None:
            self._decisions.inc(1, tags={"decision": decision})
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, GroupRequest) and request.trace_context:
            tracing.record_route(request.trace_context, started_ns, time.time_ns(), {
                "tandem.route.replica_group": chosen.unique_id, "tandem.route.decision": decision,
                "tandem.route.prefix_cached_tokens": held.get(chosen.unique_id, 0),
                "tandem.route.score": scores[chosen], "tandem.route.num_candidates": len(scores)})

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[int]:
        """The prompt's block hash chain, for a `generate` call under prefix routing."""
        if self.prefix is None or pending_request is None or pending_request.metadata.call_method != "generate":
            return []
        args = pending_request.args
        request = args[0] if args else pending_request.kwargs.get("request")
        if not isinstance(request, GroupRequest):
            return []
        return self.prefix.block_hashes(request.prompt_token_ids)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        prediction = self._predicted.pop(id(pending_request), None)
        if prediction is not None and prediction.block_hashes and self.prefix is not None:
            # Where it went (Serve passes over a full group), not where it was ranked first.
            self.prefix.recent.record(prediction.block_hashes, replica_id.unique_id)
        self._routed.setdefault(replica_id, Counter())[pending_request.metadata.internal_request_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Also called for requests a replica rejected (never routed): those find no count.
        counts = self._routed.get(replica_id)
        if counts is not None and counts[internal_request_id] > 0:
            self.completions.record(replica_id, time.time())  # wall clock, as the groups' stats_time
            counts[internal_request_id] -= 1
            if counts[internal_request_id] == 0:
                del counts[internal_request_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._routed.pop(replica_id, None)
        self.completions.forget(replica_id)
        if self.prefix is not None:
            self.prefix.recent.forget_group(replica_id.unique_id)
        for key in [k for k, p in self._predicted.items() if p.group == replica_id]:
            del self._predicted[key]
        super().on_replica_actor_died(replica_id)
        from tandem.router import known_groups

        self._publish(known_groups.known_groups(self._deployment_id.app_name, self._deployment_id.name)
                      - {replica_id.unique_id})


# What decided a request's group: a prefix credit, the load, or that the ingress's router knew
# one group only (the request went on the ingress's channel to it: router/engine_client.py).
DECISIONS = ("prefix", "load", "only_group")


def decisions_counter(app_name: str) -> Any:
    """The router-decision counter (`ray.util.metrics`), every decision at zero from the start.
    The router and the ingress each count theirs: Ray adds up a metric across processes."""
    from ray.util.metrics import Counter

    counter = Counter("tandem_router_decisions", "Requests routed, by what decided the group",
                      tag_keys=("application", "decision"))
    counter.set_default_tags({"application": app_name})
    for name in DECISIONS:
        start_at_zero(counter, {"decision": name})
    return counter


def _request_field(pending_request: PendingRequest | None, key: str) -> str | None:
    """A routing hint on a group call's message: `target_group` (a call meant for one group)
    or `avoid_group` (a retry after that group failed)."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], key, None)
