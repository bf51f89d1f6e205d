"""The host KV tier: `HostKVTier` alone (slots in LRU order, pinning, the copies it queues;
events through the manager), then through the real engine (evicted prefixes come back from
host memory)."""

from __future__ import annotations

import random

import pytest

from tandem.workers.core.block_pool import BlockPool, LocalCapacity
from tandem.workers.core.host_tier import HostKVTier
from tandem.workers.core.kv_cache_manager import KVCacheManager
from tandem.workers.core.request import Request, SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy


def test_save_queues_a_copy_and_evicts_least_recent_when_full():
    tier = HostKVTier(2)
    assert tier.save(block_id=5, block_hash=50) == (True, None)
    assert tier.save(block_id=6, block_hash=60) == (True, None)
    assert tier.saves == [(5, 0), (6, 1)]
    tier.load(0, block_id=9, block_hash=50)  # 50 is now most recent
    tier.drain()
    assert tier.save(block_id=7, block_hash=70) == (True, 60)  # 60 was least recent: dropped
    assert tier.lookup(70) == 1 and tier.lookup(60) is None and tier.lookup(50) == 0


def test_saving_a_hash_already_held_copies_nothing():
    tier = HostKVTier(2)
    tier.save(1, 10)
    tier.drain()
    assert tier.save(3, 10) == (True, None)
    assert tier.saves == [] and tier.num_saved == 1


def test_pinned_slots_are_never_saved_over_until_drained():
    tier = HostKVTier(1)
    tier.save(1, 10)
    tier.drain()
    tier.pin([0])
    assert tier.save(2, 20) == (False, None)  # the only slot is being read this step
    tier.drain()
    assert tier.save(2, 20) == (True, 10)


def test_reserve_gives_a_slot_without_a_device_copy():
    tier = HostKVTier(2)
    assert tier.reserve(10) == (0, None)
    assert tier.reserve(10) == (None, None)  # already here
    assert tier.saves == [] and tier.lookup(10) == 0
    with pytest.raises(ValueError):
        HostKVTier(0)


def _manager(num_blocks: int, host_slots: int) -> KVCacheManager:
    pool = BlockPool(LocalCapacity(num_blocks), num_blocks, record_events=True)
    kv = KVCacheManager(pool, block_size=2, enable_prefix_caching=True)
    kv.enable_host_tier(host_slots)
    return kv


def _finish(kv: KVCacheManager, req: Request, tokens: int) -> None:
    req.num_computed_tokens = tokens
    kv.cache_blocks(req)
    kv.free(req)


def test_manager_saves_evicted_blocks_and_loads_them_back_as_computed():
    kv = _manager(num_blocks=3, host_slots=4)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(), arrival_seq=0)
    assert kv.allocate_slots(a, 5) is not None
    _finish(kv, a, 5)  # blocks [1,2] and [3,4] cached
    b = Request("b", [9, 9, 9, 9, 9], SamplingParams(), arrival_seq=1)
    kv.allocate_slots(b, 5)  # takes all three blocks: both cached ones are evicted to host
    saves, loads = kv.drain_host_copies()
    assert len(saves) == 2 and loads == []
    assert [e.kind for e in kv.pool.drain_events()] == ["stored", "stored"]  # still held (on host)
    kv.free(b)
    again = Request("c", [1, 2, 3, 4, 7], SamplingParams(), arrival_seq=2)
    assert kv.get_computed_blocks(again) == []
    slots = kv.get_host_hits(again, 0)
    assert len(slots) == 2
    new = kv.allocate_slots(again, 1, [], host_slots=slots)
    assert len(new) == 3 and len(again.block_ids) == 3
    saves, loads = kv.drain_host_copies()
    assert loads == list(zip(slots, new[:2]))
    assert kv.pool.lookup(again.block_hashes[0]) == new[0]  # published at once: valid from this step
    kv.free(again)
    kv.pool.check_all_free()


def test_removed_event_only_when_a_hash_leaves_both_tiers():
    kv = _manager(num_blocks=2, host_slots=1)
    a = Request("a", [1, 2, 3], SamplingParams(), arrival_seq=0)
    kv.allocate_slots(a, 3)
    _finish(kv, a, 3)  # one cached block: [1, 2]
    kv.pool.drain_events()
    b = Request("b", [5, 6, 7, 8, 9], SamplingParams(), arrival_seq=1)
    kv.allocate_slots(b, 4)  # evicts [1,2] to host: no event
    assert kv.pool.drain_events() == []
    _finish(kv, b, 4)  # [5,6] and [7,8] stored
    kv.drain_host_copies()
    c = Request("c", [0, 0, 0, 0, 0], SamplingParams(), arrival_seq=2)
    kv.allocate_slots(c, 4)  # evicts both: host keeps one, pushing [1,2] out, and drops one
    kinds = [e.kind for e in kv.pool.drain_events()]
    assert kinds.count("removed") == 2 and kinds.count("stored") == 2


BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=[1, 4], ids=["one_pass", "multi_step"])
def llm(llama_dir: str, request) -> LLM:
    # 40 device blocks (160 tokens): a few prompts evict each other; the host keeps 64 blocks.
    # Multi-step decoding allocates a step's slots ahead, which may evict (and save) blocks too.
    probe = LLM(llama_dir, block_size=BLOCK, num_kv_blocks=40)
    block_bytes = probe.engine.executor.kv_bytes_per_block()
    del probe
    return LLM(llama_dir, block_size=BLOCK, num_kv_blocks=40, host_kv_cache_memory=64 * block_bytes,
               num_scheduler_steps=request.param)


def prompts(seed: int, num: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(num)]


def _request(tokens: list[int]):
    from tandem.workers.core.request import Request

    return Request("probe", tokens, GREEDY, arrival_seq=0)


def run(llm: LLM, batch: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)


def test_an_evicted_prefix_is_loaded_from_host_memory_with_identical_output(llm: LLM, llama_dir: str) -> None:
    [prefix] = prompts(1, 1, 60)
    first = prefix + [11, 12, 13]
    again = prefix + [21, 22, 23, 24, 25]
    assert run(llm, [first])[0].outputs[0].token_ids == hf_greedy(llama_dir, [first], 8)[0]
    loaded_before = llm.engine.stats()["host_kv_blocks_loaded"]
    for other in prompts(2, 2, 100):  # each fills most of the device cache: the prefix is evicted
        run(llm, [other])
    assert llm.engine.scheduler.kv.get_computed_blocks(_request(again)) == []  # not on the device
    out = run(llm, [again])[0]
    assert out.num_cached_tokens == 60  # 15 whole blocks, all from host memory
    assert llm.engine.stats()["host_kv_blocks_loaded"] - loaded_before == 15
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, [again], 8)[0]
    llm.engine.pool.check_all_free()


def test_host_hits_follow_device_hits_in_a_batch_under_pressure(llm: LLM, llama_dir: str) -> None:
    shared = prompts(3, 3, 48)
    for p in shared:
        run(llm, [p + [7]])
    batch = [p + [8, 9] for p in shared] + prompts(4, 2, 70)  # more than the device holds at once
    outs = run(llm, batch)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, batch, 8)
    assert sum(o.num_cached_tokens for o in outs[:3]) > 0
    llm.engine.pool.check_all_free()
    stats = llm.engine.stats()
    assert stats["host_kv_blocks_used"] <= stats["host_kv_blocks_total"] == 64


def test_host_tier_needs_prefix_caching_and_room_for_a_block(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="host_kv_cache_memory"):
        LLM(llama_dir, num_kv_blocks=8, host_kv_cache_memory=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="hold no KV block"):
        LLM(llama_dir, num_kv_blocks=8, host_kv_cache_memory=1)
