"""Ground truth: greedy output equals transformers token for token, for every family
and with every feature that changes how the work is scheduled."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import ARCHITECTURES, hf_greedy, mixed_prompts, tiny_model

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

LAYOUTS = {
    "default": {},
    # 16-token budget: the 90-token prompt takes six steps, mixed with the others' decodes.
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    # 30 blocks of 4 tokens cannot hold all four sequences: someone is preempted.
    "preemption": {"num_kv_blocks": 30, "block_size": 4},
    "no_prefix_caching": {"enable_prefix_caching": False},
    # Steps overlapped with the host's work, each scheduled ahead on its predecessor's tokens.
    "overlapped": {"overlap_steps": True},
    "overlapped_chunked": {"overlap_steps": True, "max_num_batched_tokens": 16, "max_num_seqs": 4},
    "overlapped_preemption": {"overlap_steps": True, "num_kv_blocks": 30, "block_size": 4},
    # Multi-step decoding: up to 4 forward passes a step, each fed the last one's tokens on the device.
    "multi_step": {"num_scheduler_steps": 4},
    "multi_step_chunked": {"num_scheduler_steps": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4},
    "multi_step_preemption": {"num_scheduler_steps": 3, "num_kv_blocks": 30, "block_size": 4},
    # Both: multi-step steps scheduled ahead on the last pass's tokens, admissions overlapped too.
    "overlapped_multi_step": {"overlap_steps": True, "num_scheduler_steps": 4},
    "overlapped_multi_step_chunked": {"overlap_steps": True, "num_scheduler_steps": 4,
                                      "max_num_batched_tokens": 16, "max_num_seqs": 4},
    "overlapped_multi_step_preemption": {"overlap_steps": True, "num_scheduler_steps": 3, "num_kv_blocks": 30,
                                         "block_size": 4},
}


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_transformers(arch: str, layout: str) -> None:
    model = tiny_model(arch)
    prompts = mixed_prompts()
    llm = LLM(model, **LAYOUTS[layout])
    scheduler, ahead, passes = llm.engine.scheduler, [], []
    schedule = scheduler.schedule

    def record(pending=frozenset(), max_steps=1, num_ahead=1, *slots):
        ahead.append(bool(pending))
        out = schedule(pending, max_steps, num_ahead, *slots)
        passes.append(out.num_steps)
        return out

    scheduler.schedule = record
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, MAX_TOKENS)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if layout.endswith("preemption"):
        assert llm.engine.scheduler.num_preemptions > 0
    # Overlapped: most steps were scheduled ahead, on tokens still in flight; never otherwise.
    assert (sum(ahead) > len(ahead) // 2) if layout.startswith("overlapped") else not any(ahead)
    # Multi-step: some steps ran as many passes as allowed; without it, every step ran one.
    assert max(passes) == (LAYOUTS[layout].get("num_scheduler_steps", 1))
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_cache_hits_do_not_change_outputs(arch: str) -> None:
    model = tiny_model(arch)
    base = mixed_prompts(seed=3, lengths=(50,))[0]
    prompts = [base + suffix for suffix in ([11, 12], [13], [14, 15, 16], [])] + [base[:33]]
    llm = LLM(model, block_size=8)
    first = _generate(llm, prompts[:1])  # fills the cache with the shared prefix
    rest = _generate(llm, prompts[1:])
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(model, prompts, MAX_TOKENS)
    # The first 48 tokens (6 full blocks of 8) are shared; base[:33] reuses 4 blocks.
    assert [o.num_cached_tokens for o in rest] == [48, 48, 48, 32]
    llm.engine.pool.check_all_free()


def test_n_equals_two_shares_the_prompt_and_matches(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=5, lengths=(37, 9))
    llm = LLM(llama_dir, block_size=8)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _generate(llm, prompts, params)
    refs = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    for out, ref in zip(outs, refs):
        assert [c.index for c in out.outputs] == [0, 1]
        assert [c.token_ids for c in out.outputs] == [ref, ref]
    # The second sequence of the 37-token prompt reused its sibling's 4 full blocks.
    assert outs[0].num_cached_tokens == 32
    llm.engine.pool.check_all_free()


def test_chunked_prefill_off_still_matches(llama_dir: str) -> None:
    prompts = mixed_prompts()
    llm = LLM(llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=512)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == hf_greedy(llama_dir, prompts, MAX_TOKENS)


def test_llama3_rope_scaling_matches() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    model = tiny_model("llama", rope_scaling=scaling, num_key_value_heads=1)
    prompts = mixed_prompts(seed=9, lengths=(70, 5))
    llm = LLM(model)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == hf_greedy(model, prompts, MAX_TOKENS)


def test_mistral_sliding_window_matches() -> None:
    model = tiny_model("mistral", sliding_window=24)
    prompts = mixed_prompts(seed=11, lengths=(60, 20))
    llm = LLM(model, max_num_batched_tokens=32, max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == hf_greedy(model, prompts, MAX_TOKENS)


def test_sharded_checkpoint_loads_the_same(llama_dir: str) -> None:
    sharded = tiny_model("llama", max_shard_size="40KB")
    prompts = mixed_prompts(lengths=(12,))
    outs = _generate(LLM(sharded), prompts)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, MAX_TOKENS)
