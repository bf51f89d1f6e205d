"""Fetching a prefix from another group: `FetchCost` (fetch only when the transfer beats
recomputing), then the host KV tier and the fetch in a served application: a group that
misses a prefix another group holds fetches its blocks; outputs equal recomputation."""

from __future__ import annotations

import random

import pytest
import requests

from tandem.workers.serving.kv_fetch import FetchCost, KVFetcher
from tandem.workers.serving.messages import GroupStats, StatsRequest
from tandem.workers.text.tokenizer import load_tokenizer
from tests.conftest import hf_greedy
from tests.serve.conftest import allocator, group_handle, held_by, serve_app, wait_for


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


BLOCK = 16
PREFIX_BLOCKS = 8


@pytest.fixture(scope="module")
def server(shared_ray, tiny_llama):
    # Load-only routing, so one prefix reaches both groups; every miss fetches.
    args = {"model": tiny_llama, "num_replicas": 2, "max_model_len": 512, "num_kv_blocks": 128,
            "block_size": BLOCK, "served_model_name": "tiny", "routing": "load", "kv_fetch": "always",
            "host_kv_cache_memory": 4 << 20, "host_kv_memory_per_node": 6 << 20}
    with serve_app(args) as url:
        yield url


def complete(server: str, prompt: list[int]) -> tuple[str, int, list[int]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return (r.headers["x-tandem-groups"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
            r.json()["choices"][0]["text"])


def group_stats(group_id: str) -> GroupStats:
    return group_handle().stats.remote(StatsRequest(target_group=group_id)).result(timeout_s=30)


@pytest.mark.slow
def test_a_group_fetches_a_prefix_it_never_computed_and_outputs_are_unchanged(server, tiny_llama):
    rng = random.Random(5)
    prefix = [rng.randrange(3, 200) for _ in range(PREFIX_BLOCKS * BLOCK)]
    holder, cached, _ = complete(server, prefix + [1, 2, 3])
    assert cached == 0
    # The fetch finds the holder through the directory, which lags a publish interval.
    assert wait_for(lambda: held_by(prefix + [1], BLOCK).get(holder) == PREFIX_BLOCKS, timeout_s=10)
    # Send the prefix again until load-only routing picks the other group.
    for attempt in range(30):
        prompt = prefix + [4 + attempt, 5]
        group, cached, text = complete(server, prompt)
        if group != holder:
            break
    else:
        pytest.fail("load-only routing never chose the second group")
    assert cached == PREFIX_BLOCKS * BLOCK  # fetched from the holder, not recomputed
    assert text == load_tokenizer(tiny_llama).decode(hf_greedy(tiny_llama, [prompt], 6)[0])
    stats = group_stats(group)
    assert stats.group_id == group
    assert stats.kv_fetches == 1 and stats.kv_blocks_fetched == PREFIX_BLOCKS
    assert stats.host_kv_blocks_loaded == PREFIX_BLOCKS
    # Block accounting: both groups idle, every device block free again.
    for g in (holder, group):
        assert wait_for(lambda g=g: (s := group_stats(g)).kv_blocks_free == s.kv_blocks_total)


@pytest.mark.slow
def test_host_leases_share_the_node_budget(server):
    import ray

    actor = allocator()
    capacity = ray.get(actor.capacity.remote())
    assert capacity["host_bytes_leased"] == 6 << 20  # 4 MiB to the first group, 2 MiB left for the second
    leases = sorted(u["host_bytes"] for u in ray.get(actor.usage.remote()).values())
    assert leases == [2 << 20, 4 << 20]
