"""Prompt logprobs take bounded memory: a step scores its prompt positions a slice of rows at
a time (each slice's logits and log-softmax are vocabulary-wide), with the same result as all
at once; and the KV cache's sizing profiles one such slice in the prefill step's peak."""

from __future__ import annotations

import math

import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tandem.workers.runner import gpu_memory
from tandem.workers.sample import sampler
from tests.conftest import mixed_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)


def test_prompt_positions_scored_in_slices_equal_all_at_once(llama_dir: str) -> None:
    # One 64-token step holds the whole 40-token prompt: 39 positions to score.
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
              enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": mixed_prompts(seed=33, lengths=(40,))[0]}]
    runner = llm.engine.executor.runner
    whole = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    runner.prompt_logprob_rows = 4
    scored_rows: list[int] = []
    compute_logits = runner.model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        scored_rows.append(hidden.shape[0])
        return compute_logits(hidden)

    runner.model.compute_logits = counted
    sliced = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    # The same tokens and ranks; the logprobs to float32 rounding (a 4-row GEMM is not a 39-row one).
    assert len(whole.prompt_logprobs) == 40 and sliced.prompt_logprobs[0] is whole.prompt_logprobs[0] is None
    for got, want in zip(sliced.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert {t: e.rank for t, e in got.items()} == {t: e.rank for t, e in want.items()}
        assert all(math.isclose(got[t].logprob, want[t].logprob, abs_tol=1e-5) for t in want)
    assert sliced.outputs[0].token_ids == whole.outputs[0].token_ids
    # The prefill step's one sampled row, then ten slices of at most 4 rows (39 positions).
    assert scored_rows[:11] == [1] + [4] * 9 + [3]
    llm.engine.pool.check_all_free()


def test_the_profiled_prefill_step_scores_one_slice_of_prompt_rows(llama_dir: str, monkeypatch) -> None:
    """gpu_memory's profile, run on the CPU with the CUDA memory calls stubbed: the prefill
    step's peak includes one slice of prompt rows' logprobs (the decode step's does not)."""
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    runner = llm.engine.executor.runner
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    scored: list[tuple[int, int, int]] = []
    logprob_tensors = sampler.logprob_tensors

    def seen(logits: torch.Tensor, chosen: torch.Tensor, k: int):
        scored.append((logits.shape[0], logits.shape[1], k))
        return logprob_tensors(logits, chosen, k)

    monkeypatch.setattr(sampler, "logprob_tensors", seen)
    runner.prompt_logprob_rows = 16
    assert gpu_memory.profile_steps(runner, llm.engine.config.scheduler) == (0, 0)
    assert scored == [(16, llm.engine.hf_config.vocab_size, gpu_memory.PROFILED_TOP_LOGPROBS)]
    llm.shutdown()
