"""A TP=2 replica group behind the API gives the offline LLM's greedy text, token for token."""

from __future__ import annotations

import openai
import pytest

from tests.serve.conftest import serve_app

PROMPTS = ["The quick brown fox", "It was the best of times, it was the worst of times"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline_texts(tiny_llama) -> list[str]:
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM

    llm = LLM(model=tiny_llama, max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def server(tiny_llama, offline_texts):
    with serve_app({"model": tiny_llama, "tensor_parallel_size": 2, "max_model_len": 256,
                    "num_kv_blocks": 64, "served_model_name": "tiny"}) as url:
        yield url


def test_tp2_greedy_text_equals_offline_llm(server, offline_texts):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == offline_texts
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == offline_texts[0]
