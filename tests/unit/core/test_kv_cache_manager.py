from __future__ import annotations

from tandem.workers.core.block_pool import BlockEvent, BlockPool, LocalCapacity, hash_block
from tandem.workers.core.kv_cache_manager import KVCacheManager
from tandem.workers.core.request import Request, SamplingParams

BS = 4


def make_kv(num_blocks: int = 8, prefix: bool = True, record_events: bool = False) -> KVCacheManager:
    pool = BlockPool(LocalCapacity(num_blocks), num_blocks, record_events=record_events)
    return KVCacheManager(pool, BS, enable_prefix_caching=prefix)


def make_req(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=32), arrival_seq=0)


def computed_and_cached(kv: KVCacheManager, req_id: str, prompt: list[int]) -> Request:
    """A request whose whole prompt was computed and published."""
    req = make_req(req_id, prompt)
    assert kv.allocate_slots(req, len(prompt)) is not None
    req.num_computed_tokens = len(prompt)
    kv.cache_blocks(req)
    return req


PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens


# --- allocate_slots ---------------------------------------------------------------------------

def test_allocate_slots_block_counts_at_block_boundaries() -> None:
    kv = make_kv(8)
    req = make_req("a", list(range(8)))
    assert kv.allocate_slots(req, 8) == [0, 1]  # exactly two full blocks
    req.num_computed_tokens = 8
    req.output_token_ids.append(50)
    assert kv.allocate_slots(req, 1) == [2]  # token 9 opens a third block
    req.num_computed_tokens = 9
    req.output_token_ids.append(51)
    assert kv.allocate_slots(req, 1) == []  # still room in block 2
    assert req.block_ids == [0, 1, 2]
    other = make_req("b", list(range(9)))
    assert kv.allocate_slots(other, 9) == [3, 4, 5]
    assert kv.pool.num_free_blocks == 2


def test_allocate_slots_for_a_chunk() -> None:
    kv = make_kv(8)
    req = make_req("a", list(range(20)))
    assert kv.allocate_slots(req, 5) == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3) == []  # 8 tokens fit in 2 blocks
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 12) == [2, 3, 4]


def test_lookahead_reserves_extra_blocks() -> None:
    kv = make_kv(8)
    req = make_req("a", list(range(4)))
    assert kv.allocate_slots(req, 4) == [0]
    req.num_computed_tokens = 4
    req.output_token_ids.append(50)
    # 4 computed + 1 new + 3 lookahead = 8 slots = 2 blocks.
    assert kv.allocate_slots(req, 1, num_lookahead=3) == [1]
    # + 4 lookahead = 9 slots = 3 blocks.
    assert kv.allocate_slots(req, 1, num_lookahead=4) == [2]
    assert req.block_ids == [0, 1, 2]


def test_allocate_slots_fails_when_the_pool_is_short() -> None:
    kv = make_kv(2)
    req = make_req("a", list(range(9)))
    assert kv.allocate_slots(req, 9) is None
    assert req.block_ids == []
    assert kv.pool.num_free_blocks == 2
    assert kv.allocate_slots(req, 8) == [0, 1]


# --- prefix hits ------------------------------------------------------------------------------

def test_prefix_hits_are_full_blocks_only() -> None:
    kv = make_kv(8)
    a = computed_and_cached(kv, "a", PROMPT)
    assert a.block_ids == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 2  # the partial third block is not published
    assert kv.get_computed_blocks(make_req("b", PROMPT)) == [0, 1]
    assert kv.get_computed_blocks(make_req("c", PROMPT + [7, 7, 7])) == [0, 1]
    assert kv.get_computed_blocks(make_req("d", PROMPT[:4] + [0] * 6)) == [0]
    assert kv.get_computed_blocks(make_req("e", [0] + PROMPT[1:])) == []  # the chain breaks at block 0
    assert kv.get_computed_blocks(make_req("f", PROMPT[:3])) == []


def test_prefix_hit_never_covers_the_whole_sequence() -> None:
    kv = make_kv(8)
    computed_and_cached(kv, "a", PROMPT)
    # 8 tokens = exactly the two cached blocks: the last block is recomputed so
    # its last token yields logits.
    assert kv.get_computed_blocks(make_req("b", PROMPT[:8])) == [0]
    # 9 tokens: both blocks hit, one token left to compute.
    assert kv.get_computed_blocks(make_req("c", PROMPT[:9])) == [0, 1]
    assert kv.get_computed_blocks(make_req("d", PROMPT[:4])) == []


def test_no_prefix_hits_when_caching_is_off() -> None:
    kv = make_kv(8, prefix=False)
    computed_and_cached(kv, "a", PROMPT)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_req("b", PROMPT)) == []


def test_get_computed_blocks_takes_no_reference() -> None:
    kv = make_kv(8)
    a = computed_and_cached(kv, "a", PROMPT)
    kv.get_computed_blocks(make_req("b", PROMPT))
    assert kv.pool.ref_cnt[:3] == [1, 1, 1]
    kv.free(a)
    kv.pool.check_all_free()


def test_allocate_slots_with_hits_shares_blocks() -> None:
    kv = make_kv(8)
    computed_and_cached(kv, "a", PROMPT)
    b = make_req("b", PROMPT + [7])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    # 8 cached + 3 new = 11 tokens = 3 blocks: one new.
    assert kv.allocate_slots(b, 3, hits) == [3]
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]


def test_allocate_slots_with_hits_in_the_free_queue() -> None:
    kv = make_kv(4)
    a = computed_and_cached(kv, "a", PROMPT)
    kv.free(a)  # free queue: [3, 2, 1, 0]; 0 and 1 still cached
    b = make_req("b", PROMPT)
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 2, hits) == [3]
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.ref_cnt == [1, 1, 0, 1]
    assert kv.pool.num_free_blocks == 1


def test_failed_allocation_with_hits_is_atomic() -> None:
    kv = make_kv(4)
    a = computed_and_cached(kv, "a", PROMPT)
    kv.free(a)  # free queue: [3, 2, 1, 0]
    x = make_req("x", [0] * 8)
    assert kv.allocate_slots(x, 8) == [3, 2]  # only the two cached blocks are left free
    b = make_req("b", PROMPT + [1, 2, 3, 4])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    # 14 tokens need 4 blocks: 2 hits + 2 new, but taking the hits leaves 0 free.
    assert kv.allocate_slots(b, 6, hits) is None
    assert b.block_ids == []
    assert kv.pool.ref_cnt == [0, 0, 1, 1]
    assert kv.pool.num_free_blocks == 2
    assert kv.pool.lookup(b.block_hashes[0]) == 0  # nothing was evicted
    assert kv.pool.lookup(b.block_hashes[1]) == 1
    kv.free(x)
    kv.pool.check_all_free()


def test_failed_allocation_with_hits_held_by_others_is_atomic() -> None:
    kv = make_kv(4)
    a = computed_and_cached(kv, "a", PROMPT)  # holds 0, 1, 2
    b = make_req("b", PROMPT + list(range(10)))  # 20 tokens: 5 blocks
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 12, hits) is None
    assert kv.pool.ref_cnt == [1, 1, 1, 0]
    assert b.block_ids == []
    kv.free(a)
    kv.pool.check_all_free()


def test_a_lookup_hashes_up_to_its_first_miss_and_computing_hashes_the_rest() -> None:
    kv = make_kv(16)
    computed_and_cached(kv, "a", PROMPT)  # blocks [100..103], [104..107]
    # The same two blocks, then a different third: hashed as far as the first miss.
    req = make_req("b", PROMPT[:8] + list(range(200, 213)))
    hits = kv.get_computed_blocks(req)
    assert len(hits) == 2 and len(req.block_hashes) == 3
    chain = []
    for i in range(5):
        chain.append(hash_block(chain[-1] if chain else None, req.all_token_ids[i * BS:(i + 1) * BS]))
    assert req.block_hashes == chain[:3]
    assert kv.get_computed_blocks(req) == hits and len(req.block_hashes) == 3  # asked again: nothing new
    # Once computed, publishing hashes the blocks the lookup never reached.
    assert kv.allocate_slots(req, 13, computed_blocks=hits) is not None
    req.num_computed_tokens = 21
    kv.cache_blocks(req)
    assert req.block_hashes == chain
    assert [kv.pool.lookup(h) for h in chain] == req.block_ids[:5]


# --- publishing -------------------------------------------------------------------------------

def test_cache_blocks_publishes_only_computed_full_blocks() -> None:
    kv = make_kv(8, record_events=True)
    req = make_req("a", PROMPT)
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    h0 = hash_block(None, PROMPT[:4])
    h1 = hash_block(h0, PROMPT[4:8])
    req.num_computed_tokens = 3
    kv.cache_blocks(req)
    assert kv.pool.num_cached_blocks == 0
    req.num_computed_tokens = 6
    kv.cache_blocks(req)
    assert kv.pool.drain_events() == [BlockEvent("stored", h0, None)]
    assert kv.pool.block_hash == [h0] + [None] * 7
    req.num_computed_tokens = 10
    kv.cache_blocks(req)
    kv.cache_blocks(req)  # idempotent
    assert kv.pool.drain_events() == [BlockEvent("stored", h1, h0)]
    assert kv.pool.lookup(h1) == 1
    assert req.block_hashes == [h0, h1]
    assert kv.pool.num_cached_blocks == 2


def test_cache_blocks_covers_output_tokens() -> None:
    kv = make_kv(8)
    req = make_req("a", [1, 2, 3])
    kv.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    req.output_token_ids.append(4)
    kv.allocate_slots(req, 1)
    req.num_computed_tokens = 4
    req.output_token_ids.append(5)
    kv.cache_blocks(req)
    assert kv.pool.lookup(hash_block(None, [1, 2, 3, 4])) == 0


def test_cache_blocks_skips_hits_that_are_already_published() -> None:
    kv = make_kv(8, record_events=True)
    computed_and_cached(kv, "a", PROMPT)
    kv.pool.drain_events()
    b = make_req("b", PROMPT[:8] + [7, 7, 7, 7, 7])
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 5, hits) == [3, 4]
    b.num_computed_tokens = 13
    kv.cache_blocks(b)
    h2 = hash_block(b.block_hashes[1], [7, 7, 7, 7])
    assert kv.pool.drain_events() == [BlockEvent("stored", h2, b.block_hashes[1])]
    assert kv.pool.lookup(h2) == 3


def test_cache_blocks_does_nothing_when_caching_is_off() -> None:
    kv = make_kv(8, prefix=False, record_events=True)
    req = make_req("a", PROMPT)
    kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    kv.cache_blocks(req)
    assert kv.pool.num_cached_blocks == 0
    assert kv.pool.events == []


# --- trim and free --------------------------------------------------------------------------

def test_trim_frees_tail_blocks() -> None:
    kv = make_kv(8)
    req = make_req("a", list(range(4)))
    assert kv.allocate_slots(req, 4, num_lookahead=8) == [0, 1, 2]
    kv.trim(req, 8)
    assert req.block_ids == [0, 1]
    kv.trim(req, 8)  # nothing beyond
    assert req.block_ids == [0, 1]
    kv.trim(req, 5)  # 5 tokens still need 2 blocks
    assert req.block_ids == [0, 1]
    kv.trim(req, 4)
    assert req.block_ids == [0]
    assert kv.pool.ref_cnt[:3] == [1, 0, 0]
    # Trimmed blocks went to the back of the free queue.
    assert kv.pool.allocate(7) == [3, 4, 5, 6, 7, 2, 1]


def test_free_releases_every_block_tail_first() -> None:
    kv = make_kv(4)
    a = computed_and_cached(kv, "a", PROMPT)
    kv.free(a)
    assert a.block_ids == []
    kv.pool.check_all_free()
    # Tail first: the uncached block 3, then a's tail, and its head last.
    assert kv.pool.allocate(4) == [3, 2, 1, 0]
    assert kv.pool.num_cached_blocks == 0


def test_free_forgets_what_was_published() -> None:
    kv = make_kv(8, record_events=True)
    a = computed_and_cached(kv, "a", PROMPT)
    kv.free(a)
    kv.pool.reset_prefix_cache()
    kv.pool.drain_events()
    # The same request id admitted again (e.g. after preemption) publishes from scratch.
    a.num_computed_tokens = 0
    assert kv.allocate_slots(a, 10) == [3, 4, 5]
    a.num_computed_tokens = 10
    kv.cache_blocks(a)
    assert [e.kind for e in kv.pool.drain_events()] == ["stored", "stored"]
    assert kv.pool.lookup(a.block_hashes[0]) == 3


def test_capacity_tokens() -> None:
    assert make_kv(8).capacity_tokens == 32
