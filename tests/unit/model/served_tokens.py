"""What the model-source tests share: a model's greedy tokens, served then shut down."""

from __future__ import annotations

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM

PROMPTS = [[11, 12, 13, 14], [200, 300]]


def greedy_tokens(llm: LLM) -> list[list[int]]:
    """8 greedy tokens for each of PROMPTS; the engine is shut down after."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
