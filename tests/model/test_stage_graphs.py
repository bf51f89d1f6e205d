"""CUDA graphs per pipeline stage, on CPU with capture off: each stage pads a decode step to its
own graph bucket and runs its layers through the graph path (stage 0 from the token ids, a later
stage from its hidden-state input buffer), the last one to logits. Greedy output equals
transformers. The stages run in this process (tests/stage_chain.py), each a real ModelRunner."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tandem.workers.core.request import SamplingParams  # noqa: E402
from tandem.workers.llm import LLM  # noqa: E402
from tandem.workers.runner.model_runner import ModelRunner  # noqa: E402
from tests.conftest import hf_greedy, mixed_prompts, tiny_model  # noqa: E402
from tests.stage_chain import use_stage_chain  # noqa: E402

pytestmark = pytest.mark.slow  # the engine through Triton's interpreter: not in the fast loop

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# (stages, steps in flight) -> the (bucket, requests) pairs of every padded step
CASES = {(2, 2): {(4, 3), (2, 2)}, (2, 1): {(8, 5)}, (3, 3): {(2, 2), (1, 1)}}


@pytest.mark.parametrize("pp,inflight", list(CASES))
def test_each_stage_replays_its_own_decode_buckets(monkeypatch, pp: int, inflight: int) -> None:
    monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")
    use_stage_chain(monkeypatch, "cpu")
    model = tiny_model("llama", num_hidden_layers=pp)  # one layer a stage (a middle one reads and hands on)
    prompts = mixed_prompts(seed=2, lengths=(5, 9, 21, 7, 12))
    llm = LLM(model, device="cpu", dtype="float32", attention_backend="triton", pipeline_parallel_size=pp,
              pipeline_inflight_batches=inflight, max_num_seqs=8, block_size=4, num_kv_blocks=64,
              max_seq_len_to_capture=24)
    runners = llm.engine.executor.runners
    assert [r.graphs.hidden_in is None for r in runners] == [True] + [False] * (pp - 1)  # later ones: hidden in
    assert all(r.mixed_graphs is None for r in runners)  # mixed steps stay eager on a stage
    seen: list[list[tuple[int | None, int]]] = [[] for _ in range(pp)]
    for stage, runner in enumerate(runners):
        build = runner.builder.build

        def record(out, states, table, graph=None, source=None, _build=build, _seen=seen[stage], **kwargs):
            inputs = _build(out, states, table, graph, source, **kwargs)
            _seen.append((inputs.graph_batch, len(inputs.req_ids)))
            return inputs

        runner.builder.build = record
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          use_tqdm=False)] == hf_greedy(model, prompts, MAX_TOKENS)
    assert all(stage == seen[0] for stage in seen)  # every stage pads a step alike
    # Two slots in flight: three requests decode in one (padded to 4), two in the other; one
    # slot: all five at once (padded to 8); three slots: two, two and one.
    assert {(batch, n) for batch, n in seen[0] if batch is not None} == CASES[pp, inflight]
    # Prefill steps, and decodes past the 24-token capture length, ran eagerly on every stage.
    assert any(batch is None for batch, _ in seen[0])
    llm.engine.pool.check_all_free()
    llm.shutdown()
