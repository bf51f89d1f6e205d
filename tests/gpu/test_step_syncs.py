"""Overlapped steps on a GPU hold only while launching a step never waits for the device: no
synchronising operation anywhere in a greedy run's steps (torch's sync debug mode counts them;
the engine's one wait a step is a CUDA event, which it does not). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.bench.host_syncs import host_sync_figures
from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 16


@pytest.mark.parametrize("mixed_step_graphs", [True, False])
def test_greedy_steps_never_make_the_host_wait_for_the_gpu(llama_dir: str, mixed_step_graphs: bool) -> None:
    # Prompts arrive while others decode, long ones in chunks beside decodes: padded decode
    # graphs, mixed graphs (or those steps eager) and steps scheduled ahead of their tokens.
    prompts = mixed_prompts(seed=9, lengths=(60, 3, 30, 9, 5, 22))
    llm = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3, mixed_step_graphs=mixed_step_graphs)
    assert llm.engine.overlap_steps
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = []
    fig = host_sync_figures(lambda: outputs.extend(
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)))
    assert fig["gpu_host_syncs"] == 0, fig["gpu_host_sync_sites"]
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm.shutdown()
