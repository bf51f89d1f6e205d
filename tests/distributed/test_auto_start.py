"""`LLM(..., tensor_parallel_size=2)` with no Ray running starts a local instance itself."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, tiny_model

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop

def test_llm_starts_local_ray_when_none_is_running(monkeypatch) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # Hermetic: never join a cluster something else on this machine may have started.
    monkeypatch.setenv("RAY_ADDRESS", "local")
    model = tiny_model("qwen2")
    llm = LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert ray.is_initialized()
        # Even on a 2-core machine the local instance has room for all four workers.
        assert ray.cluster_resources()["CPU"] >= 4
        prompt = [31, 32, 33, 34, 35]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(model, [prompt], 6)[0]
    finally:
        llm.shutdown()
        ray.shutdown()
