"""FetchCost: fetch a prefix from another group only when the transfer beats recomputing it."""

from __future__ import annotations

import pytest

from tandem.workers.serving.kv_fetch import FetchCost, KVFetcher


def test_fetch_pays_when_moving_the_bytes_is_faster_than_the_prefill():
    cost = FetchCost(overhead_s=0.01, bandwidth_bytes_per_s=1e9, min_blocks=2)
    # 10 blocks of 1 MB: 0.01 + 0.01 s to fetch; 160 tokens at 1000 tok/s: 0.16 s to recompute.
    assert cost.pays(10, 1_000_000, 16, prefill_tokens_per_s=1000.0)
    # The same blocks on a fast accelerator (100k tok/s: 1.6 ms): recompute.
    assert not cost.pays(10, 1_000_000, 16, prefill_tokens_per_s=100_000.0)


def test_too_few_blocks_never_pay_and_an_unmeasured_group_fetches():
    cost = FetchCost(min_blocks=4)
    assert not cost.pays(3, 1, 16, prefill_tokens_per_s=1.0)
    assert cost.pays(4, 10**9, 16, prefill_tokens_per_s=None)  # no measurement yet: assume it pays


def test_unknown_fetch_mode_is_refused():
    with pytest.raises(ValueError, match="kv_fetch: must be one of auto, always, never"):
        KVFetcher(engine=None, group_id="g", app_name="a", layout="l", mode="sometimes")
