"""KV blocks between replica groups on Ray: the host tier at TP=2 x PP=2, and a prefix
exported by one TP=2 group (object refs, worker to worker) and imported by another."""

from __future__ import annotations

import random

import pytest

from tandem.workers.core.block_pool import prompt_block_hashes
from tandem.workers.core.request import SamplingParams
from tandem.workers.engine.kv_transfer import export_prefix, held_prefix, import_prefix
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, tiny_model

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(length)]


def _run(llm: LLM, prompt: list[int]):
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]


def test_host_tier_at_tp2_pp2(ray_local) -> None:
    model = tiny_model("llama")
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, block_size=BLOCK, num_kv_blocks=40,
              host_kv_cache_memory=1 << 20)
    try:
        prefix = _prompt(1, 60)
        _run(llm, prefix + [1])
        for seed in (2, 3):
            _run(llm, _prompt(seed, 100))  # evict the prefix from the device
        again = prefix + [2, 3, 4]
        out = _run(llm, again)
        assert out.num_cached_tokens == 60
        assert out.outputs[0].token_ids == hf_greedy(model, [again], 8)[0]
        assert llm.engine.stats()["host_kv_blocks_loaded"] >= 15
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()


def test_prefix_moves_between_two_tp2_groups(ray_local) -> None:
    model = tiny_model("llama")
    options = dict(tensor_parallel_size=2, block_size=BLOCK, num_kv_blocks=64, host_kv_cache_memory=1 << 20)
    source, sink = LLM(model, **options), LLM(model, **options)
    try:
        prefix = _prompt(4, 48)
        _run(source, prefix + [9])
        hashes = prompt_block_hashes(prefix + [9], BLOCK)
        assert held_prefix(source.engine, hashes) == 12 and held_prefix(sink.engine, hashes) == 0
        num, refs = export_prefix(source.engine, hashes)
        assert num == 12 and len(refs) == 2  # one object ref per rank
        assert import_prefix(sink.engine, hashes, refs) == 12
        assert held_prefix(sink.engine, hashes) == 12
        prompt = prefix + [5, 6]
        out = _run(sink, prompt)
        assert out.num_cached_tokens == 48  # imported, not recomputed
        assert out.outputs[0].token_ids == hf_greedy(model, [prompt], 8)[0]
        sink.engine.pool.check_all_free()
        source.engine.pool.check_all_free()
    finally:
        source.shutdown()
        sink.shutdown()
