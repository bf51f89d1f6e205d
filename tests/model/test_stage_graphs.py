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


@pytest.mark.parametrize("inflight", [2, 1])
def test_each_stage_replays_its_own_decode_buckets(monkeypatch, inflight: int) -> None:
    monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")
    use_stage_chain(monkeypatch, "cpu")
    model = tiny_model("llama", num_hidden_layers=2)  # one layer a stage
    prompts = mixed_prompts(seed=2, lengths=(5, 9, 21, 7, 12))
    llm = LLM(model, device="cpu", dtype="float32", attention_backend="triton", pipeline_parallel_size=2,
              pipeline_inflight_batches=inflight, max_num_seqs=8, block_size=4, num_kv_blocks=64,
              max_seq_len_to_capture=24)
    runners = llm.engine.executor.runners
    assert [r.graphs.hidden_in is None for r in runners] == [True, False]  # stage 1 reads hidden states
    assert all(r.mixed_graphs is None for r in runners)  # mixed steps stay eager on a stage
    seen: list[list[tuple[int | None, int]]] = [[], []]
    for stage, runner in enumerate(runners):
        build = runner.builder.build

        def record(out, states, table, graph=None, source=None, _build=build, _seen=seen[stage], **kwargs):
            inputs = _build(out, states, table, graph, source, **kwargs)
            _seen.append((inputs.graph_batch, len(inputs.req_ids)))
            return inputs

        runner.builder.build = record
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          use_tqdm=False)] == hf_greedy(model, prompts, MAX_TOKENS)
    assert seen[0] == seen[1]  # every stage pads a step alike
    padded = {(batch, n) for batch, n in seen[0] if batch is not None}
    # Two slots in flight: the three requests decode one and two a step; one slot: all three at once.
    # Two slots in flight: three requests decode in one (padded to 4), two in the other; one
    # slot: all five at once (padded to 8).
    assert padded == ({(4, 3), (2, 2)} if inflight == 2 else {(8, 5)})
    # Prefill steps, and decodes past the 24-token capture length, ran eagerly on every stage.
    assert {n for batch, n in seen[0] if batch is None} == ({2, 3} if inflight == 2 else {5})
    llm.engine.pool.check_all_free()
    llm.shutdown()
