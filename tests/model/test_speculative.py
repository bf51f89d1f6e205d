"""Speculative decoding: greedy output identical, sampled output distributed as the target."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.core.request import Request, SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, hf_logits, mixed_prompts, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
FORCED = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 32, "max_num_seqs": 4},
    "preempt": {"block_size": 4, "num_kv_blocks": 40},
}


@pytest.fixture(scope="module")
def draft_dir(llama_dir: str, tmp_path_factory) -> str:
    """A different, smaller model sharing the target's tokenizer."""
    from transformers import AutoTokenizer

    from tandem.workers.model.demo_model import create_model_dir

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    return create_model_dir(tmp_path_factory.mktemp("draft"), vocab_size=512, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, seed=99,
                            tokenizer=tokenizer)


def _copy_heavy_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds continuations."""
    base = mixed_prompts(seed=31, lengths=(12, 7, 20))
    return [p * 3 for p in base] + [mixed_prompts(seed=32, lengths=(50,))[0]]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


@pytest.mark.parametrize("layout", list(FORCED))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_output_is_unchanged(llama_dir: str, k: int, layout: str) -> None:
    prompts = _copy_heavy_prompts()
    llm = LLM(llama_dir, speculative_model="ngram", num_speculative_tokens=k, **FORCED[layout])
    assert _run(llm, prompts) == hf_greedy(llama_dir, prompts, 24)
    assert llm.engine.num_draft_tokens > 0
    if layout == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize(("k", "layout"), [(1, "plain"), (3, "chunked"), (5, "preempt")])
def test_draft_model_greedy_output_is_unchanged(llama_dir: str, draft_dir: str, k: int, layout: str) -> None:
    prompts = mixed_prompts(seed=33)
    llm = LLM(llama_dir, speculative_model=draft_dir, num_speculative_tokens=k, **FORCED[layout])
    assert _run(llm, prompts) == hf_greedy(llama_dir, prompts, 24)
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert 0.0 <= stats["spec_acceptance_rate"] <= 1.0
    llm.engine.pool.check_all_free()


def test_self_draft_accepts_everything(llama_dir: str) -> None:
    llm = LLM(llama_dir, speculative_model=llama_dir, num_speculative_tokens=3)
    prompts = mixed_prompts(seed=34, lengths=(9,))
    assert _run(llm, prompts) == hf_greedy(llama_dir, prompts, 24)
    stats = llm.engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accepted_length"] > 3.0  # 3 drafts + the bonus, short steps at the end


def test_draft_with_another_vocabulary_is_refused(llama_dir: str) -> None:
    other = tiny_model("llama", vocab_size=600)
    with pytest.raises(ValueError, match="^speculative_model: its vocabulary"):
        LLM(llama_dir, speculative_model=other, num_speculative_tokens=2)


class FixedDraft:
    """Always drafts one fixed token: exercises acceptance and residual resampling."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, requests: list[Request]) -> None:
        for req in requests:
            req.spec_token_ids = [self.token]


def test_sampled_outputs_follow_the_target_distribution(llama_dir: str) -> None:
    """Chi-square on the second token: drawn by verification, it must follow p(. | prompt, t1)."""
    prompt = mixed_prompts(seed=35, lengths=(6,))[0]
    params = dict(temperature=1.5, top_k=4, max_tokens=3, ignore_eos=True)  # room for one draft
    logits = hf_logits(llama_dir, prompt)[-1] / 1.5
    t1 = int(logits.argmax())
    nxt = hf_logits(llama_dir, prompt + [t1])[-1].float() / 1.5
    top = nxt.topk(4)
    p = torch.softmax(top.values, -1)
    support = top.indices.tolist()
    llm = LLM(llama_dir, max_num_seqs=256, max_num_batched_tokens=4096, num_lookahead_slots=1)
    llm.engine.proposer = FixedDraft(support[1])  # a plausible but not the likeliest token
    trials = 3000
    llm.engine.spec_policy.disable_batch_size = trials  # draft in every step, however large the batch
    outs = llm.generate([{"prompt_token_ids": prompt}] * trials,
                        [SamplingParams(seed=s, **params) for s in range(trials)], use_tqdm=False)
    seconds = [o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == t1]
    assert len(seconds) > 500
    assert llm.engine.num_draft_tokens > 0 and 0 < llm.engine.num_accepted_draft_tokens < llm.engine.num_draft_tokens
    assert set(seconds) <= set(support)
    observed = torch.tensor([seconds.count(t) for t in support], dtype=torch.float64)
    expected = p.double() * len(seconds)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, observed.tolist(), expected.tolist())  # 3 dof, p = 0.001
    llm.engine.pool.check_all_free()


def test_seeded_sampling_with_speculation_is_reproducible(llama_dir: str) -> None:
    prompts = _copy_heavy_prompts()
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    runs = [_run(LLM(llama_dir, speculative_model="ngram", num_speculative_tokens=3), prompts, params)
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_speculation_switches_off_for_large_batches(llama_dir: str) -> None:
    prompts = [p * 3 for p in mixed_prompts(seed=36, lengths=(10,) * 6)]
    llm = LLM(llama_dir, speculative_model="ngram", num_speculative_tokens=3, disable_batch_size=4)
    assert _run(llm, prompts) == hf_greedy(llama_dir, prompts, 24)
    assert llm.engine.num_draft_tokens == 0  # six running requests > 4: compute-bound, no drafts
    small = LLM(llama_dir, speculative_model="ngram", num_speculative_tokens=3, disable_batch_size=8)
    _run(small, prompts)
    assert small.engine.num_draft_tokens > 0
