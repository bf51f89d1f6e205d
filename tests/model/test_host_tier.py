"""The host KV tier through the real engine: evicted prefixes come back from host memory."""

from __future__ import annotations

import random

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy

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
