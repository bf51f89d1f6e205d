"""Speculative decoding over a TP=2 group: greedy output unchanged, blocks accounted for."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop


@pytest.mark.parametrize(("proposer", "k"), [("ngram", 1), ("ngram", 3), ("ngram", 5), ("draft", 1), ("draft", 3),
                                             ("draft", 5)])
def test_tp2_speculation_keeps_greedy_output(ray_local, llama_dir: str, proposer: str, k: int) -> None:
    """Chunked prefill (32 tokens a step) and preemption (36 blocks of 4) both forced."""
    prompts = [p * 3 for p in mixed_prompts(seed=41, lengths=(9, 15))] + mixed_prompts(seed=42, lengths=(30,))
    spec_model = "ngram" if proposer == "ngram" else llama_dir
    llm = LLM(llama_dir, tensor_parallel_size=2, speculative_model=spec_model, num_speculative_tokens=k,
              block_size=4, num_kv_blocks=36, max_num_batched_tokens=32, max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 20)
        assert llm.engine.num_accepted_draft_tokens > 0
        assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()
