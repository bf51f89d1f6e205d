"""Pipeline stages kept busy (CPU, gloo): with P stages, up to P steps of different requests are
in flight at once (`pipeline_inflight_batches`, default P), and greedy output still equals
transformers token for token, with chunked prefill and preemption forced, prefix caching,
n-gram and draft-model speculation, and an abort while its step is on the workers. One step
at a time (`pipeline_inflight_batches=1`) is still there."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts, tiny_model

pytestmark = pytest.mark.slow  # Ray workers: not in the fast loop

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 64-token steps split the 90-token prompt, and 30 blocks of 4 tokens cannot hold every sequence.
STRESS = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "num_kv_blocks": 30, "block_size": 4}
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # one block of 16

CASES = {
    # name: (model options, pp, engine options, steps in flight at most)
    "pp3-stress": ({"num_hidden_layers": 3}, 3, {**STRESS, "max_num_seqs": 6, "num_kv_blocks": 40}, 3),
    "pp2-ngram": ({}, 2, {"speculative_model": "ngram", "num_speculative_tokens": 3, **STRESS}, 2),
    "pp2-draft": ({}, 2, {"speculative_model": "DRAFT", "num_speculative_tokens": 3}, 2),
    "pp2-prefix": ({}, 2, {}, 2),
    "pp2-one-at-a-time": ({}, 2, {"pipeline_inflight_batches": 1, **STRESS}, 1),
}


def _prompts(case: str) -> list[list[int]]:
    if case == "pp2-prefix":  # every prompt starts with the same block: later ones hit the cache
        return [SHARED + p for p in mixed_prompts(seed=5, lengths=(3, 20, 7, 30))]
    if case == "pp2-ngram":  # repeats, so the n-gram proposer finds drafts
        return [p * 3 for p in mixed_prompts(seed=41, lengths=(9, 15))] + mixed_prompts(seed=42, lengths=(30, 4))
    if case == "pp3-stress":  # two a slot
        return mixed_prompts(lengths=(3, 17, 40, 90, 8, 25))
    return mixed_prompts()


def _count_in_flight(llm: LLM) -> list[int]:
    engine, most = llm.engine, [0]
    launch = engine._launch

    def counted(*args, **kwargs):
        launch(*args, **kwargs)
        most[0] = max(most[0], len(engine._in_flight))

    engine._launch = counted
    return most


@pytest.mark.parametrize("case", list(CASES))
def test_steps_in_flight_keep_greedy_output(ray_local, case: str) -> None:
    spec, pp, options, in_flight = CASES[case]
    model = tiny_model("llama", **spec)
    if options.get("speculative_model") == "DRAFT":
        options = {**options, "speculative_model": model}  # the model drafts for itself: most drafts accepted
    prompts = _prompts(case)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    llm = LLM(model, pipeline_parallel_size=pp, **options)
    try:
        most = _count_in_flight(llm)
        if case == "pp2-prefix":  # the shared block cached by a first request, then hit from both slots
            first = llm.generate([{"prompt_token_ids": SHARED + [30, 31]}], GREEDY, use_tqdm=False)
            assert first[0].outputs[0].token_ids == hf_greedy(model, [SHARED + [30, 31]], MAX_TOKENS)[0]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert most[0] == in_flight
        engine = llm.engine
        if "num_kv_blocks" in options:
            assert engine.scheduler.num_preemptions > 0
        if "speculative_model" in options:
            assert engine.num_accepted_draft_tokens > 0
        if case == "pp2-prefix":
            assert engine.scheduler.num_prefix_hit_tokens == 4 * len(SHARED)
        engine.pool.check_all_free()
    finally:
        llm.shutdown()


def test_an_abort_while_its_step_is_on_the_workers(ray_local) -> None:
    """The aborted request's blocks go back at once and may go to a request of the next step;
    each stage runs the steps in order, so nothing the others read is overwritten early."""
    model = tiny_model("llama")
    prompts = mixed_prompts(lengths=(5, 17, 9, 30))
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    llm = LLM(model, pipeline_parallel_size=2, block_size=4, num_kv_blocks=40)
    engine = llm.engine
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
        engine.add_request("gone", {"prompt_token_ids": prompts[3]}, GREEDY)
        done: dict[str, list[int]] = {}
        aborted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id != "gone":
                    done[out.request_id] = out.outputs[0].token_ids
            in_flight = {r for step, _, _ in engine._in_flight for r in step.num_scheduled_tokens}
            if not aborted and "gone" in in_flight:
                engine.abort_request("gone")
                aborted = True
                engine.add_request("after", {"prompt_token_ids": prompts[1]}, GREEDY)  # takes its blocks
        assert aborted
        assert [done[f"r{i}"] for i in range(4)] == expected
        assert done["after"] == expected[1]
        engine.pool.check_all_free()
    finally:
        llm.shutdown()
