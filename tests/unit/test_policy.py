"""The routing policy: pure scoring, no Serve."""

from __future__ import annotations

import math

import pytest

from tandem.router.policy import LoadWeights, rank_by_score, score_load


def test_idle_group_scores_zero():
    assert score_load({}) == 0.0
    assert score_load({"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}) == 0.0


def test_score_counts_running_waiting_and_kv_usage():
    stats = {"num_running": 3, "num_waiting": 2, "kv_usage": 0.5}
    # outstanding 5 + waiting 2 * 1.0 + kv 0.5 * 4.0
    assert score_load(stats) == 5 + 2 + 2.0
    assert score_load(stats, weights=LoadWeights(waiting=0.0, kv_usage=10.0)) == 5 + 5.0


def test_in_flight_count_covers_stale_stats_without_double_counting():
    stats = {"num_running": 2, "num_waiting": 0, "kv_usage": 0.0}
    assert score_load(stats, num_in_flight=1) == 2  # already in the reported figure
    assert score_load(stats, num_in_flight=5) == 5  # sent since the last poll


def test_unhealthy_group_scores_infinity():
    assert score_load({"is_healthy": False, "num_running": 0}) == math.inf


def test_rank_groups_equal_scores_share_a_tier_best_first():
    scores = {"a": 3.0, "b": 1.0, "c": 3.0, "d": math.inf, "e": 0.5}
    assert rank_by_score(scores) == [["e"], ["b"], ["a", "c"], ["d"]]


def test_rank_prefers_less_loaded_group():
    busy = {"num_running": 8, "num_waiting": 4, "kv_usage": 0.9}
    idle = {"num_running": 1, "num_waiting": 0, "kv_usage": 0.1}
    assert rank_by_score({"busy": score_load(busy), "idle": score_load(idle)})[0] == ["idle"]


def test_fuller_cache_loses_a_tie_on_requests():
    assert score_load({"num_running": 2, "kv_usage": 0.8}) > score_load({"num_running": 2, "kv_usage": 0.2})


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="weights"):
        LoadWeights(waiting=-1.0)
