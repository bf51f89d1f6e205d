"""`run_tandem`'s decode phase: timed from the step after which every request has a token to the
end, over the tokens the longest request still needed then, however steps are overlapped or
how many passes each carries."""

from __future__ import annotations

import pytest

from tandem.bench.tandem_runs import run_tandem
from tandem.bench.workload import BenchRequest
from tandem.workers.llm import LLM
from tests.conftest import tiny_model


@pytest.mark.parametrize("options", [{}, {"overlap_steps": True}, {"num_scheduler_steps": 4, "overlap_steps": True}],
                         ids=["plain", "overlapped", "multi_step_overlapped"])
def test_decode_phase_counts_every_token_after_the_first(options: dict) -> None:
    llm = LLM(tiny_model("llama"), device="cpu", **options)
    requests = [BenchRequest(list(range(5, 25)), 6), BenchRequest(list(range(30, 37)), 9)]
    result = run_tandem(llm, requests, record_inputs=True, show_progress=False)
    assert result.num_output_tokens == 15
    # Both prompts are prefilled in the first step, so each has one token before decoding starts.
    assert result.decode_tokens == 8
    assert 0 < result.decode_s < result.elapsed_s
    assert result.time_per_decode_token_s == result.decode_s / 8
    assert result.decode_inputs and all(not step.meta.prefills for step in result.decode_inputs)
    llm.shutdown()
