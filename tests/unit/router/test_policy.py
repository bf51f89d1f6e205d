"""The routing policy: pure scoring, no Serve."""

from __future__ import annotations

import math

import pytest

from tandem.router.policy import CompletionLog, LoadWeights, rank_by_score, score_load
from tandem.workers.serving.messages import RoutingStats


def test_idle_group_scores_zero():
    assert score_load(RoutingStats()) == 0.0
    assert score_load(RoutingStats(num_running=0, num_waiting=0, kv_usage=0.0)) == 0.0


def test_score_counts_running_waiting_and_kv_usage():
    stats = RoutingStats(num_running=3, num_waiting=2, kv_usage=0.5)
    # outstanding 5 + waiting 2 * 1.0 + kv 0.5 * 4.0
    assert score_load(stats) == 5 + 2 + 2.0
    assert score_load(stats, weights=LoadWeights(waiting=0.0, kv_usage=10.0)) == 5 + 5.0


def test_in_flight_count_covers_stale_stats_without_double_counting():
    stats = RoutingStats(num_running=2, num_waiting=0, kv_usage=0.0)
    assert score_load(stats, num_in_flight=1) == 2  # already in the reported figure
    assert score_load(stats, num_in_flight=5) == 5  # sent since the last poll


def test_unhealthy_group_scores_infinity():
    assert score_load(RoutingStats(is_healthy=False, num_running=0)) == math.inf


def test_rank_groups_equal_scores_share_a_tier_best_first():
    scores = {"a": 3.0, "b": 1.0, "c": 3.0, "d": math.inf, "e": 0.5}
    assert rank_by_score(scores) == [["e"], ["b"], ["a", "c"], ["d"]]


def test_rank_prefers_less_loaded_group():
    busy = RoutingStats(num_running=8, num_waiting=4, kv_usage=0.9)
    idle = RoutingStats(num_running=1, num_waiting=0, kv_usage=0.1)
    assert rank_by_score({"busy": score_load(busy), "idle": score_load(idle)})[0] == ["idle"]


def test_fuller_cache_loses_a_tie_on_requests():
    assert score_load(RoutingStats(num_running=2, kv_usage=0.8)) > score_load(RoutingStats(num_running=2, kv_usage=0.2))


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="weights"):
        LoadWeights(waiting=-1.0)


# ---- prefix-aware scoring -------------------------------------------------------------------------
from tandem.router.policy import PrefixWeights, score_prefix  # noqa: E402


def test_prefix_credit_is_cached_tokens_over_tokens_per_request():
    weights = PrefixWeights(tokens_per_request=256, max_imbalance=4)
    scores = score_prefix({"a": 2.0, "b": 1.0}, {"a": 512}, weights)
    assert scores == {"a": 0.0, "b": 1.0}  # a's 512 cached tokens outweigh one more queued request


def test_a_short_hit_does_not_outweigh_a_longer_queue():
    scores = score_prefix({"a": 3.0, "b": 1.0}, {"a": 32}, PrefixWeights(tokens_per_request=256))
    assert rank_by_score(scores)[0] == ["b"]


def test_no_credit_beyond_the_imbalance_bound():
    weights = PrefixWeights(tokens_per_request=100, max_imbalance=4)
    # a holds the whole prompt but is 5 requests above b: over the bound, scored on load alone.
    assert score_prefix({"a": 5.0, "b": 0.0}, {"a": 10_000}, weights) == {"a": 5.0, "b": 0.0}
    # at the bound it still gets its credit
    assert score_prefix({"a": 4.0, "b": 0.0}, {"a": 1000}, weights) == {"a": -6.0, "b": 0.0}


def test_hot_prefix_spills_once_the_holder_is_over_the_bound():
    weights = PrefixWeights(tokens_per_request=100, max_imbalance=3)
    loads = {"a": 0.0, "b": 0.0}
    picks = []
    for _ in range(12):  # one hot prefix, only `a` holds it, nothing finishes
        scores = score_prefix(loads, {"a": 10_000}, weights)
        best = rank_by_score(scores)[0][0]
        picks.append(best)
        loads[best] += 1
    assert picks[:4] == ["a"] * 4  # up to the bound
    assert max(loads.values()) - min(loads.values()) <= weights.max_imbalance + 1


def test_unhealthy_groups_are_left_alone_and_bound_uses_healthy_ones():
    scores = score_prefix({"a": math.inf, "b": 1.0}, {"a": 1000, "b": 0}, PrefixWeights())
    assert scores == {"a": math.inf, "b": 1.0}
    assert score_prefix({"a": math.inf}, {"a": 5}, PrefixWeights()) == {"a": math.inf}


def test_bad_prefix_weights_are_refused():
    with pytest.raises(ValueError, match="tokens_per_request"):
        PrefixWeights(tokens_per_request=0)


def test_requests_seen_to_finish_since_the_poll_come_off_the_polled_load():
    stats = RoutingStats(num_running=6, num_waiting=2, kv_usage=0.0)
    assert score_load(stats) == 8 + 2
    assert score_load(stats, num_done_since_poll=3) == 5 + 0  # the queue drained into the seats freed
    assert score_load(stats, num_done_since_poll=20) == 0.0  # never below nothing
    assert score_load(stats, num_in_flight=4, num_done_since_poll=8) == 4  # sent since: still counted


def test_completion_log_counts_what_finished_after_a_poll():
    log = CompletionLog(keep_s=10.0)
    for t in (1.0, 2.0, 3.0):
        log.record("g", t)
    assert [log.since("g", at) for at in (0.5, 1.5, 3.0)] == [3, 2, 0]
    assert log.since("g", None) == 0 and log.since("other", 0.0) == 0
    log.record("g", 20.0)  # older than keep_s is dropped
    assert log.since("g", 0.0) == 1
    log.forget("g")
    assert log.since("g", 0.0) == 0
