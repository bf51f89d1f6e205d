from __future__ import annotations

import hashlib
import struct

import pytest

from tandem.workers.core.block_pool import BlockEvent, BlockPool, LocalCapacity, hash_block


def make_pool(num_blocks: int = 8, record_events: bool = False) -> BlockPool:
    return BlockPool(LocalCapacity(num_blocks), num_blocks, record_events=record_events)


def chain(*blocks: list[int]) -> list[int]:
    """Hashes of consecutive full blocks, each chained to the one before."""
    hashes: list[int] = []
    for tokens in blocks:
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
    return hashes


# --- capacity -------------------------------------------------------------------------------

def test_local_capacity_grants_up_to_its_budget() -> None:
    cap = LocalCapacity(10)
    assert cap.acquire(4) == 4
    assert cap.acquire(10) == 6
    assert cap.acquire(1) == 0
    assert cap.granted == 10
    cap.release(6)
    assert cap.granted == 4
    assert cap.acquire(5) == 5
    with pytest.raises(AssertionError):
        cap.release(10)


def test_pool_size_is_what_the_source_grants_and_close_returns_it() -> None:
    cap = LocalCapacity(5)
    pool = BlockPool(cap, 8)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert cap.granted == 5
    pool.close()
    assert cap.granted == 0


def test_pool_refuses_an_empty_grant() -> None:
    cap = LocalCapacity(4)
    cap.acquire(4)
    with pytest.raises(AssertionError):
        BlockPool(cap, 4)


# --- allocation and reference counts --------------------------------------------------------

def test_fresh_pool_hands_out_blocks_in_order() -> None:
    pool = make_pool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.ref_cnt == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.usage == 5 / 8
    assert pool.allocate(0) == []


def test_allocating_more_than_free_is_an_internal_error() -> None:
    pool = make_pool(2)
    with pytest.raises(AssertionError):
        pool.allocate(3)


def test_touch_and_free_count_references() -> None:
    pool = make_pool(4)
    ids = pool.allocate(2)
    pool.touch(ids)
    assert pool.ref_cnt == [2, 2, 0, 0]
    pool.free([1, 0])
    assert pool.ref_cnt == [1, 1, 0, 0]
    assert pool.num_free_blocks == 2  # still held once
    pool.free([1, 0])
    assert pool.ref_cnt == [0, 0, 0, 0]
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([0])


def test_free_tail_first_puts_blocks_at_the_lru_tail() -> None:
    pool = make_pool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([2, 1, 0])  # a request's blocks, tail first
    # Never-used blocks come first, then the freed tail, then the freed head.
    assert pool.allocate(6) == [3, 4, 5, 2, 1, 0]


def test_freed_blocks_are_reused_in_free_order() -> None:
    pool = make_pool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2])
    pool.free([0])
    pool.free([3])
    assert pool.allocate(3) == [2, 0, 3]


# --- prefix cache ---------------------------------------------------------------------------

def test_cache_and_lookup() -> None:
    pool = make_pool(4)
    h0, h1 = chain([1, 2], [3, 4])
    a, b = pool.allocate(2)
    pool.cache(a, h0, None)
    pool.cache(b, h1, h0)
    assert pool.lookup(h0) == 0
    assert pool.lookup(h1) == 1
    assert pool.lookup(hash_block(None, [9, 9])) is None
    assert pool.block_hash == [h0, h1, None, None]
    assert pool.num_cached_blocks == 2


def test_cache_keeps_the_first_block_for_a_hash_and_a_block_keeps_its_first_hash() -> None:
    pool = make_pool(4, record_events=True)
    h0, h1 = chain([1, 2], [3, 4])
    a, b = pool.allocate(2)
    pool.cache(a, h0, None)
    pool.cache(b, h0, None)  # the same prefix computed twice: keep block a
    pool.cache(a, h1, h0)  # block a is already published
    assert pool.lookup(h0) == a
    assert pool.lookup(h1) is None
    assert pool.block_hash == [h0, None, None, None]
    assert pool.drain_events() == [BlockEvent("stored", h0, None)]


def test_cached_free_blocks_are_evicted_lru_with_events() -> None:
    pool = make_pool(4, record_events=True)
    h0, h1, h2 = chain([1, 2], [3, 4], [5, 6])
    assert pool.allocate(3) == [0, 1, 2]
    pool.cache(0, h0, None)
    pool.cache(1, h1, h0)
    pool.cache(2, h2, h1)
    assert pool.drain_events() == [BlockEvent("stored", h0, None), BlockEvent("stored", h1, h0),
                                   BlockEvent("stored", h2, h1)]
    assert pool.drain_events() == []
    pool.free([2, 1, 0])
    # Free blocks stay findable until the pool needs them.
    assert pool.num_free_blocks == 4
    assert pool.num_cached_blocks == 3
    assert (pool.lookup(h0), pool.lookup(h1), pool.lookup(h2)) == (0, 1, 2)
    assert pool.events == []  # freeing alone evicts nothing
    # Block 3 (never cached) goes first, then the prefix tail.
    assert pool.allocate(2) == [3, 2]
    assert pool.drain_events() == [BlockEvent("removed", h2)]
    assert pool.lookup(h2) is None
    assert pool.block_hash == [h0, h1, None, None]
    assert pool.allocate(1) == [1]
    assert pool.drain_events() == [BlockEvent("removed", h1)]
    assert pool.lookup(h0) == 0
    assert pool.num_cached_blocks == 1


def test_no_events_without_record_events() -> None:
    pool = make_pool(2)
    (h0,) = chain([1, 2])
    pool.allocate(1)
    pool.cache(0, h0, None)
    pool.free([0])
    pool.allocate(2)
    assert pool.events == []
    assert pool.drain_events() == []
    assert pool.lookup(h0) is None


def test_touch_on_a_cached_free_block_takes_it_off_the_free_queue() -> None:
    pool = make_pool(3)
    (h0,) = chain([1, 2])
    assert pool.allocate(1) == [0]
    pool.cache(0, h0, None)
    pool.free([0])
    assert pool.num_free_blocks == 3
    pool.touch([pool.lookup(h0)])
    assert pool.ref_cnt == [1, 0, 0]
    assert pool.num_free_blocks == 2
    # The touched block is no longer handed out, and it keeps its hash.
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(h0) == 0
    pool.free([0])
    pool.free([2, 1])
    assert pool.allocate(3) == [0, 2, 1]


def test_reset_prefix_cache_forgets_only_free_blocks() -> None:
    pool = make_pool(4, record_events=True)
    h0, h1 = chain([1, 2], [3, 4])
    pool.allocate(2)
    pool.cache(0, h0, None)
    pool.cache(1, h1, h0)
    pool.drain_events()
    pool.free([1])
    pool.reset_prefix_cache()
    assert pool.lookup(h0) == 0  # still in use
    assert pool.lookup(h1) is None
    assert pool.drain_events() == [BlockEvent("removed", h1)]
    pool.free([0])
    pool.check_all_free()


def test_reset_prefix_cache_leaves_the_free_queue_as_it_was() -> None:
    pool = make_pool(6, record_events=True)
    h0, h1, h2 = chain([1, 2], [3, 4], [5, 6])
    ids = pool.allocate(3)
    for block_id, (h, parent) in zip(ids, [(h0, None), (h1, h0), (h2, h1)]):
        pool.cache(block_id, h, parent)
    pool.drain_events()
    pool.free([2, 1, 0])  # tail first
    pool.reset_prefix_cache()
    assert [pool.lookup(h) for h in (h0, h1, h2)] == [None, None, None] and pool.num_cached_blocks == 0
    assert sorted(e.block_hash for e in pool.drain_events()) == sorted([h0, h1, h2])
    assert pool.num_free_blocks == 6
    assert pool.allocate(6) == [3, 4, 5, 2, 1, 0]  # the free queue's order is untouched
    pool.reset_prefix_cache()  # nothing cached: nothing to do
    assert pool.drain_events() == []


# --- hashing --------------------------------------------------------------------------------

def test_hash_block_is_stable_across_processes() -> None:
    # blake2b, not hash(): the cluster directory compares hashes from many processes.
    assert hash_block(None, [1, 2, 3, 4]) == -5847583744903468788
    assert hash_block(-5847583744903468788, [5, 6, 7, 8]) == -5474393373494776196
    digest = hashlib.blake2b(struct.pack("<q", -1) + struct.pack("<4q", 1, 2, 3, 4), digest_size=8).digest()
    assert hash_block(None, (1, 2, 3, 4)) == int.from_bytes(digest, "little", signed=True)


def test_hash_chain_is_deterministic() -> None:
    blocks = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    first, second = chain(*blocks), chain(*blocks)
    assert first == second
    assert len(set(first)) == 3
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, (1, 2, 3, 4))


def test_hash_covers_the_whole_prefix() -> None:
    # Same tokens in the last block, different parent -> different hash.
    a = chain([1, 2], [7, 8])
    b = chain([1, 3], [7, 8])
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert hash_block(None, [7, 8]) not in (a[1], b[1])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2, 0])


# --- accounting -----------------------------------------------------------------------------

def test_check_all_free_raises_while_a_block_is_held() -> None:
    pool = make_pool(4)
    pool.check_all_free()
    ids = pool.allocate(2)
    with pytest.raises(AssertionError, match="2 of 4 blocks still in use"):
        pool.check_all_free()
    pool.free(ids[::-1])
    pool.check_all_free()
    pool.touch([0])  # a prefix hit holds a block too
    with pytest.raises(AssertionError):
        pool.check_all_free()
    pool.free([0])
    pool.check_all_free()
