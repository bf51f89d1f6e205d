from __future__ import annotations

import pytest

from tandem.bench.spec import _copy_heavy_prompts, run_spec_bench
from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import mixed_prompts


@pytest.fixture(scope="module")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from tandem.workers.model.demo_model import create_spec_pair

    return create_spec_pair(tmp_path_factory.mktemp("pair"), vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, seed=5)


def test_copy_heavy_prompts_repeat_a_passage() -> None:
    prompts = _copy_heavy_prompts(2, 5, 100, seed=0)
    assert all(p[:5] * 3 == p for p in prompts) and prompts[0] != prompts[1]


def test_spec_bench_with_an_agreeing_draft_accepts_everything(spec_pair: tuple[str, str]) -> None:
    target, draft = spec_pair
    figures = run_spec_bench(target, quick=True, k=3, repeats=2, progress=False, draft=draft)
    assert figures["proposer"] == "draft" and figures["draft_model"] == draft
    assert figures["acceptance_rate"] == 1.0
    assert figures["mean_accepted_length"] > 3.0  # 3 drafts + the bonus, short steps at the end


def test_agreeing_draft_keeps_greedy_output(spec_pair: tuple[str, str]) -> None:
    target, draft = spec_pair
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(target).generate(prompts, params, use_tqdm=False)]
    spec = LLM(target, speculative_model=draft, num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == plain
    assert spec.engine.stats()["spec_acceptance_rate"] == 1.0
