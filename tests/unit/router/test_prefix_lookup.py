"""PrefixLookup: directory counts merged with the router's recent sends; load-only on failure."""

from __future__ import annotations

import asyncio

from tandem.router.prefix_lookup import PrefixLookup, RecentRoutes
from tandem.workers.core.block_pool import hash_block, prompt_block_hashes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_prompt_hashes_match_the_cache_manager_chain():
    tokens = list(range(40))  # block size 8: 4 full blocks servable (the last token is always computed)
    hashes = prompt_block_hashes(tokens, 8)
    assert len(hashes) == 4
    assert hashes[0] == hash_block(None, tokens[:8])
    assert hashes[3] == hash_block(hashes[2], tokens[24:32])
    assert len(prompt_block_hashes(list(range(41)), 8)) == 5
    assert prompt_block_hashes([1], 8) == []


def test_recent_routes_count_leading_blocks_per_group_and_expire():
    clock = Clock()
    recent = RecentRoutes(ttl_s=10.0, clock=clock)
    recent.record([1, 2, 3], "a")
    recent.record([1, 2, 9], "b")
    assert recent.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    clock.now += 11
    assert recent.match([1, 2, 3]) == {}
    recent.record([1], "a")
    recent.forget_group("a")
    assert recent.match([1]) == {}


def test_recent_routes_keep_at_most_capacity_hashes():
    recent = RecentRoutes(capacity=3)
    recent.record([1, 2, 3, 4, 5], "a")
    assert recent.match([1]) == {}  # the oldest went first
    assert recent.match([3, 4, 5]) == {"a": 3}


def test_lookup_merges_directory_and_recent_in_tokens():
    async def directory(hashes):
        return {"a": 2}

    lookup = PrefixLookup(16, directory)
    lookup.recent.record([7, 8, 9], "b")
    lookup.recent.record([7], "a")
    assert asyncio.run(lookup.cached_tokens([7, 8, 9])) == {"a": 32, "b": 48}
    assert lookup.directory_ok


def test_lookup_is_load_only_when_the_directory_fails_or_is_slow():
    async def broken(hashes):
        raise ConnectionError("allocator restarting")

    async def slow(hashes):
        await asyncio.sleep(5)
        return {"a": 1}

    for directory in (broken, slow):
        lookup = PrefixLookup(16, directory, timeout_s=0.05)
        lookup.recent.record([1], "a")  # the router's own memory only covers the directory's lag
        assert asyncio.run(lookup.cached_tokens([1])) == {}
        assert not lookup.directory_ok
    assert asyncio.run(PrefixLookup(16, broken).cached_tokens([])) == {}
