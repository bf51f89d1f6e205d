"""LoadAwareRouter's own bookkeeping, driven as Serve drives it (choose_replicas, then
on_request_routed for the group that took the request): a pick counts on the group
ranked first until Serve confirms the request, then on the group that took it; the
prompt's prefix is remembered where it went; with one group no directory is asked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from tandem.router import request_router
from tandem.router.prefix_lookup import PrefixLookup
from tandem.router.request_router import PREDICTION_TTL_S, LoadAwareRouter
from tandem.workers.core.request import SamplingParams
from tandem.workers.serving.messages import GroupRequest, RoutingStats

DEPLOYMENT = DeploymentID("GroupServer", "app")
G0, G1 = ReplicaID("g0", DEPLOYMENT), ReplicaID("g1", DEPLOYMENT)
BLOCK = 4


@dataclass
class Group:
    """A RunningReplica as the router sees it: its id and its last polled stats."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)


class Directory:
    """The prefix directory: holds nothing, counts the questions."""

    def __init__(self) -> None:
        self.asked = 0

    async def __call__(self, block_hashes: list[int]) -> dict[str, int]:
        self.asked += 1
        return {}


@pytest.fixture(autouse=True)
def loop():
    """Serve's pending requests each make a future: they need a current loop, as in Serve."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def router(routing: str = "load") -> tuple[LoadAwareRouter, Directory]:
    r = LoadAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    r.initialize_state(routing="load", metrics=False)
    directory = Directory()
    if routing == "prefix":
        r.prefix = PrefixLookup(BLOCK, directory)
    return r, directory


def pending(request_id: str = "http-1", prompt: tuple[int, ...] = tuple(range(12))) -> PendingRequest:
    message = GroupRequest(request_id, list(prompt), SamplingParams(max_tokens=4))
    return PendingRequest([message], {}, RequestMetadata(request_id, request_id, call_method="generate"))


# g0 reports an idle group, g1 five running requests: g0 ranks first while it has fewer.
GROUPS = [Group(G0, RoutingStats(num_running=0).as_dict()), Group(G1, RoutingStats(num_running=5).as_dict())]


def choose(r: LoadAwareRouter, request: PendingRequest, groups: list[Group] = GROUPS) -> list[ReplicaID]:
    ranked = asyncio.get_event_loop().run_until_complete(r.choose_replicas(groups, request))
    return [tier[0].replica_id for tier in ranked]


def test_a_pick_serve_passed_over_counts_on_the_group_that_took_the_request() -> None:
    r, _ = router()
    a = pending()
    assert choose(r, a) == [G0, G1]
    assert r.num_in_flight() == {G0: 1}  # predicted where it ranked first
    r.on_request_routed(a, G1, None)  # g0 was full: Serve sent it to g1
    assert r.num_in_flight() == {G1: 1}  # no phantom left on g0


def test_a_second_pick_for_the_same_request_replaces_its_first() -> None:
    r, _ = router()
    a = pending()
    choose(r, a)
    # Serve chose again for it (a rejection, a backoff): its own first pick is no load then.
    # (Counted, it would tie g0's 4 + 1 with g1's 5.)
    assert choose(r, a, [Group(G0, RoutingStats(num_running=4).as_dict()), GROUPS[1]]) == [G0, G1]
    assert choose(r, a) == [G0, G1]
    assert r.num_in_flight() == {G0: 1}
    r.on_request_routed(a, G0, None)
    assert r.num_in_flight() == {G0: 1}


def test_the_prompts_of_one_http_request_are_counted_apart() -> None:
    # Every group call of a multi-prompt completion carries the HTTP request's id.
    r, _ = router()
    first, second = pending("http-7", (1, 2, 3, 4)), pending("http-7", (5, 6, 7, 8))
    choose(r, first)
    choose(r, second)
    assert r.num_in_flight() == {G0: 2}
    r.on_request_routed(second, G0, None)
    assert r.num_in_flight() == {G0: 2}  # one routed, one still predicted
    r.on_request_completed(G0, "http-7")
    assert r.num_in_flight() == {G0: 1}


def test_a_prediction_never_confirmed_lapses(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(request_router.time, "monotonic", lambda: now[0])
    r, _ = router()
    choose(r, pending())
    assert r.num_in_flight() == {G0: 1}
    now[0] += PREDICTION_TTL_S + 0.1
    assert r.num_in_flight() == {}


def test_the_prefix_is_remembered_on_the_group_that_took_it() -> None:
    r, directory = router("prefix")
    a = pending()
    hashes = r.prefix.block_hashes(a.args[0].prompt_token_ids)
    assert choose(r, a) == [G0, G1] and directory.asked == 1
    assert r.prefix.recent.match(hashes) == {}  # not before Serve says where it went
    r.on_request_routed(a, G1, None)
    assert len(hashes) == 2 and r.prefix.recent.match(hashes) == {"g1": 2}


def test_with_one_group_no_directory_is_asked() -> None:
    r, directory = router("prefix")
    a = pending()
    assert choose(r, a, GROUPS[:1]) == [G0]
    r.on_request_routed(a, G0, None)
    assert (directory.asked, r.num_in_flight()) == (0, {G0: 1})


def test_a_dead_groups_predictions_go_with_it() -> None:
    r, _ = router()
    choose(r, pending("a"))
    choose(r, pending("b"), GROUPS[1:])
    r.on_replica_actor_died(G0)
    assert r.num_in_flight() == {G1: 1}
