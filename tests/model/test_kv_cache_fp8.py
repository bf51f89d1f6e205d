"""The FP8 KV cache end to end on the tiny models: block counts, output against the float cache,
the host tier, and KV blocks between groups (an FP8 export imports into an FP8 group only)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.cluster.kv_allocator import KVAllocatorState
from tandem.workers.config import EngineConfig
from tandem.workers.core.block_pool import prompt_block_hashes
from tandem.workers.core.request import Request, SamplingParams
from tandem.workers.engine.kv_transfer import export_prefix, held_prefix, import_prefix, kv_layout
from tandem.workers.llm import LLM

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts(seed: int, num: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(num)]


def run(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def attention_layers(llm: LLM):
    return llm.engine.executor.runner.model.attention_layers


def test_fp8_blocks_hold_twice_bf16_and_four_times_float32(llama_dir: str) -> None:
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8_e4m3")):
        llm = LLM(llama_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=1 << 20, block_size=BLOCK)
        blocks[dtype, kv] = llm.engine.num_kv_blocks
        cache = attention_layers(llm)[0].key_cache
        assert cache.dtype == (torch.float8_e4m3fn if kv != "auto" else getattr(torch, dtype))
        llm.shutdown()
    # 2 layers x K and V x 4 tokens x 2 KV heads x 16 dims: 2 KiB per fp32 block, 512 B per fp8 one.
    assert blocks["float32", "auto"] == 512 and blocks["bfloat16", "auto"] == 1024
    assert blocks["float32", "fp8"] == blocks["bfloat16", "fp8_e4m3"] == 2048


def test_fp8_generates_and_agrees_with_the_float_cache(llama_dir: str) -> None:
    """Teacher-forced top-1 agreement with the float32 cache, over every prompt position
    (prompt_logprobs). Random tiny weights give flat logits that e4m3's 3 mantissa bits flip
    more often than a trained model's: measured 0.868 here (the issue's 0.98 is for trained
    checkpoints); the positions the float cache ranks clearly (top-1 ahead by >= 0.2 nats)
    agree at 0.97."""
    batch = prompts(0, 4, 40) + prompts(1, 2, 120)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    ranked = {}
    for kv in ("auto", "fp8"):
        llm = LLM(llama_dir, kv_cache_dtype=kv, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=128)
        outs = run(llm, batch, params)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        ranked[kv] = [sorted(pos.items(), key=lambda item: item[1].rank)[:2]
                      for o in outs for pos in o.prompt_logprobs[1:]]
        llm.shutdown()
    same = [a[0][0] == b[0][0] for a, b in zip(ranked["auto"], ranked["fp8"])]
    clear = [ok for a, ok in zip(ranked["auto"], same) if a[0][1].logprob - a[1][1].logprob >= 0.2]
    assert len(same) == 4 * 39 + 2 * 119
    assert sum(same) / len(same) >= 0.85
    assert sum(clear) / len(clear) >= 0.95


def test_scales_set_after_start_up_are_what_the_kernels_use(llama_dir: str) -> None:
    """The loader's contract: python floats on each attention layer, read at every step."""
    llm = LLM(llama_dir, kv_cache_dtype="fp8", block_size=BLOCK, num_kv_blocks=16, enable_prefix_caching=False)
    [prompt] = prompts(5, 1, 10)
    base = run(llm, [prompt])[0].outputs[0].token_ids
    for attn in attention_layers(llm):
        attn.k_scale, attn.v_scale = 2.0 ** -12, 2.0 ** -12  # every value saturates at 448 * 2^-12
    saturated = run(llm, [prompt])[0].outputs[0].token_ids
    key_cache = attention_layers(llm)[0].key_cache
    assert key_cache.float().abs().max() == 448.0
    for attn in attention_layers(llm):
        attn.k_scale, attn.v_scale = 1.0, 1.0
    assert run(llm, [prompt])[0].outputs[0].token_ids == base != saturated
    llm.shutdown()


def test_fp8_host_tier_round_trips_blocks(llama_dir: str) -> None:
    probe = LLM(llama_dir, kv_cache_dtype="fp8", block_size=BLOCK, num_kv_blocks=40)
    block_bytes = probe.engine.kv_bytes_per_block()
    probe.shutdown()
    assert block_bytes == 2 * 2 * BLOCK * 2 * 16  # layers x K/V x tokens x KV heads x dims, one byte each
    llm = LLM(llama_dir, kv_cache_dtype="fp8", block_size=BLOCK, num_kv_blocks=40,
              host_kv_cache_memory=64 * block_bytes)
    assert llm.engine.executor.runner.kv_cache.host_cache[0][0].dtype == torch.float8_e4m3fn
    [prefix] = prompts(1, 1, 60)
    again = prefix + [21, 22, 23, 24, 25]
    run(llm, [prefix + [11, 12, 13]])
    for other in prompts(2, 2, 100):  # each fills most of the device cache: the prefix is evicted
        run(llm, [other])
    assert llm.engine.scheduler.kv.get_computed_blocks(Request("probe", again, GREEDY, arrival_seq=0)) == []
    out = run(llm, [again])[0]
    assert out.num_cached_tokens == 60  # 15 blocks back from host memory
    llm.shutdown()
    fresh = LLM(llama_dir, kv_cache_dtype="fp8", block_size=BLOCK, num_kv_blocks=32, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == run(fresh, [again])[0].outputs[0].token_ids
    fresh.shutdown()


def test_fp8_blocks_move_between_fp8_groups_and_a_float_group_refuses_them(llama_dir: str) -> None:
    options = dict(block_size=BLOCK, num_kv_blocks=64, host_kv_cache_memory=1 << 20)
    source = LLM(llama_dir, kv_cache_dtype="fp8", **options)
    sink = LLM(llama_dir, kv_cache_dtype="fp8", **options)
    floats = LLM(llama_dir, **options)
    try:
        [prefix] = prompts(4, 1, 48)
        run(source, [prefix + [9]])
        hashes = prompt_block_hashes(prefix + [9], BLOCK)
        num, per_rank = export_prefix(source.engine, hashes)
        assert num == 12 and per_rank[0].data.dtype == torch.float8_e4m3fn
        assert per_rank[0].scales == ((1.0, 1.0),) * 2

        with pytest.raises(ValueError, match="never exchange blocks"):
            import_prefix(floats.engine, hashes, per_rank)
        assert held_prefix(floats.engine, hashes) == 0  # the slots reserved for them are free again
        assert len(floats.engine.scheduler.kv.host) == 0

        for attn in attention_layers(sink):  # other scales: refused too
            attn.k_scale = 0.5
        with pytest.raises(ValueError, match="scales"):
            import_prefix(sink.engine, hashes, per_rank)
        for attn in attention_layers(sink):
            attn.k_scale = 1.0
        assert import_prefix(sink.engine, hashes, per_rank) == 12
        prompt = prefix + [5, 6]
        out = run(sink, [prompt])[0]
        assert out.num_cached_tokens == 48  # imported, not recomputed
        assert out.outputs[0].token_ids == run(source, [prompt])[0].outputs[0].token_ids
    finally:
        for llm in (source, sink, floats):
            llm.shutdown()


def test_the_allocator_never_pairs_groups_of_different_kv_dtypes() -> None:
    layouts = {kv: kv_layout(EngineConfig.from_options(model="m", kv_cache_dtype=kv))
               for kv in ("auto", "fp8", "fp8_e4m3")}
    assert layouts["fp8"] == layouts["fp8_e4m3"] != layouts["auto"]
    # Weights quantized otherwise, or another revision, make other K and V.
    assert len({kv_layout(EngineConfig.from_options(model="m/n", **options)) for options in (
        {}, {"quantization": "int8"}, {"quantization": "fp8"}, {"revision": "v2"})}) == 4
    allocator = KVAllocatorState()
    for group, kv in (("g-float", "auto"), ("g-fp8", "fp8")):
        allocator.register(group, "m", BLOCK, 10, "node", [1, 2, 3], kv_layout=layouts[kv])
    assert allocator.holders([1, 2, 3], layouts["fp8"]) == {"g-fp8": 3}
    assert allocator.holders([1, 2, 3], layouts["auto"]) == {"g-float": 3}


def test_checkpoint_scales_reach_the_cache_and_its_exports(llama_dir: str, tmp_path) -> None:
    """A checkpoint's `self_attn.k_scale` / `v_scale` (as FP8 checkpoints ship them: 0-d float32)
    become the layers' python floats, which the writes divide by and the exports carry."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "scaled"
    shutil.copytree(llama_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    for i, (k, v) in enumerate(((0.5, 0.25), (2.0, 0.125))):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", block_size=BLOCK, num_kv_blocks=32)
    try:
        assert [(a.k_scale, a.v_scale) for a in attention_layers(llm)] == [(0.5, 0.25), (2.0, 0.125)]
        [prompt] = prompts(6, 1, 9)
        run(llm, [prompt])
        _, [exported] = export_prefix(llm.engine, prompt_block_hashes(prompt, BLOCK))
        assert exported.scales == ((0.5, 0.25), (2.0, 0.125))
        assert exported.data.dtype == torch.float8_e4m3fn
    finally:
        llm.shutdown()
