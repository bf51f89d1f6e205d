"""Multi-step decoding through the real engine: a step of decodes runs several forward
passes, each on the tokens the pass before sampled. Output must not change: greedy equals
transformers, stops land where they would one pass at a time, sampled requests in the batch
keep their own (seeded) tokens, and every KV block comes back. The references run one pass a
step through the host sampler (`host_sampler`), which one-pass steps of decodes otherwise
leave for the device's (`PassSampler`), as multi-step steps do."""

from __future__ import annotations

import pytest

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, host_sampler, mixed_prompts

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _record_passes(llm: LLM, ahead_of: list[frozenset[str]] | None = None) -> list[int]:
    """The number of forward passes of every step the engine schedules from now on (and, into
    `ahead_of`, the requests each was scheduled ahead of the tokens of)."""
    scheduler, passes = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def record(ahead=frozenset(), max_steps=1, num_ahead=1, *slots):
        out = schedule(ahead, max_steps, num_ahead, *slots)
        passes.append(out.num_steps)
        if ahead_of is not None:
            ahead_of.append(ahead)
        return out

    scheduler.schedule = record
    return passes


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_token_inside_a_step_ends_the_output_where_one_pass_at_a_time_would(llama_dir: str,
                                                                                  overlap: bool) -> None:
    prompts = mixed_prompts(seed=8, lengths=(11, 6))
    refs = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    # The second prompt's 7th token, first seen there: a stop that lands inside a 4-pass step
    # (the prefill gives token 1, then passes give 2-5 and 6-9).
    stop_at = next(i for i in range(5, MAX_TOKENS) if refs[1][i] not in refs[1][:i] and i % 4 != 0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            stop_token_ids=[refs[1][stop_at]])
    llm = LLM(llama_dir, num_scheduler_steps=4, overlap_steps=overlap)
    passes = _record_passes(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert 4 in passes
    expected_first = refs[0][:refs[0].index(refs[1][stop_at]) + 1] if refs[1][stop_at] in refs[0] else refs[0]
    assert _token_ids(outs) == [expected_first, refs[1][:stop_at + 1]]
    assert outs[1].outputs[0].finish_reason == "stop"
    llm.engine.pool.check_all_free()
    llm.shutdown()


def _run_beside_greedy(model: str, prompts: list[list[int]], other: SamplingParams,
                       **options) -> tuple[list[list[int]], list[int]]:
    """Greedy requests with `other` as the second one: every request's tokens, and each step's passes."""
    llm = LLM(model, **options)
    passes = _record_passes(llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, other if i == 1 else GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    engine.pool.check_all_free()
    llm.shutdown()
    return [done[f"r{i}"] for i in range(len(prompts))], passes


def test_a_seeded_sampled_request_gets_the_same_tokens_in_several_passes(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=9, lengths=(13, 5, 21))
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=17, max_tokens=6, ignore_eos=True)
    with host_sampler():
        one_pass, _ = _run_beside_greedy(llama_dir, prompts, sampled)
    multi, passes = _run_beside_greedy(llama_dir, prompts, sampled, num_scheduler_steps=4)
    assert multi == one_pass  # the sampled request's seeded tokens too, drawn on the device pass by pass
    refs = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert [multi[0], multi[2]] == [refs[0], refs[2]]
    # The prefill, then 4 passes a step: the sampled request's 6th token and the greedy ones'
    # 16th come inside steps, whose passes past them are dropped (a max_tokens does not cut a step short).
    assert passes == [1, 4, 4, 4, 4]


def test_steps_scheduled_ahead_on_several_passes_keep_every_request_s_tokens(llama_dir: str) -> None:
    # Overlapped: each multi-step step is scheduled on placeholders for the last one's tokens,
    # the seeded sampled request's included; its length limit ends it inside a step.
    prompts = mixed_prompts(seed=9, lengths=(13, 5, 21, 8))
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=17, max_tokens=11, ignore_eos=True)
    with host_sampler():
        one_pass, _ = _run_beside_greedy(llama_dir, prompts, sampled)
    multi, passes = _run_beside_greedy(llama_dir, prompts, sampled, num_scheduler_steps=4, overlap_steps=True)
    assert multi == one_pass
    assert passes.count(4) >= 3


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_come_from_every_pass_as_one_pass_at_a_time_gives_them(llama_dir: str, overlap: bool) -> None:
    prompts = mixed_prompts(seed=15, lengths=(9, 14))

    def run(**options) -> tuple[list, list[int]]:
        llm = LLM(llama_dir, overlap_steps=overlap, **options)
        passes = _record_passes(llm)
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
                  SamplingParams(temperature=0.8, seed=21, max_tokens=MAX_TOKENS - 3, ignore_eos=True, logprobs=1)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.pool.check_all_free()
        llm.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in outs], passes

    with host_sampler():
        one_pass, _ = run()
    multi, passes = run(num_scheduler_steps=4)
    assert multi == one_pass  # tokens, every position's logprobs (chosen and top), their sums
    assert multi[0][0] == hf_greedy(llama_dir, prompts[:1], MAX_TOKENS)[0]
    assert passes.count(4) >= 3
    assert len(multi[0][1]) == MAX_TOKENS and all(3 <= len(lps) <= 4 for lps in multi[0][1])  # chosen + top 3


def test_a_request_with_prompt_logprobs_decodes_in_several_passes_once_its_prompt_is_scored(
        llama_dir: str) -> None:
    prompts = mixed_prompts(seed=16, lengths=(12, 7, 30))
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2),
              GREEDY]

    def run(**options) -> tuple[list, list[int]]:
        # A 10-token budget: the 30-token prompt comes in chunks beside the others' decodes.
        llm = LLM(llama_dir, max_num_batched_tokens=10, max_num_seqs=4, **options)
        passes = _record_passes(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.pool.check_all_free()
        llm.shutdown()
        return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs], passes

    one_pass, _ = run()
    multi, passes = run(num_scheduler_steps=4)
    assert multi == one_pass
    assert [tokens for tokens, _ in multi] == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert len(multi[1][1]) == 7 and passes.count(4) >= 2


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_a_stop_off_inside_several_passes(llama_dir: str, overlap: bool) -> None:
    prompts = mixed_prompts(seed=9, lengths=(13, 5, 21))
    refs = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    stop = refs[1][2]  # the second request's 3rd token: it would end there without min_tokens
    held = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=7, stop_token_ids=[stop])
    with host_sampler():
        one_pass, _ = _run_beside_greedy(llama_dir, prompts, held)
    multi, passes = _run_beside_greedy(llama_dir, prompts, held, num_scheduler_steps=4, overlap_steps=overlap)
    assert multi == one_pass
    assert len(multi[1]) >= 7 and stop not in multi[1][:6] and multi[1][:2] == refs[1][:2]
    assert passes[:3] == [1, 4, 4]  # the stop suppressed on the device, pass by pass


@pytest.mark.parametrize("overlap", [False, True])
def test_penalised_requests_get_the_same_tokens_in_several_passes(llama_dir: str, overlap: bool) -> None:
    prompts = mixed_prompts(seed=9, lengths=(13, 5, 21))
    for penalised in (SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True),
                      SamplingParams(temperature=0.8, seed=2, frequency_penalty=0.6, presence_penalty=0.3,
                                     max_tokens=10, ignore_eos=True)):
        with host_sampler():
            one_pass, _ = _run_beside_greedy(llama_dir, prompts, penalised)
        multi, passes = _run_beside_greedy(llama_dir, prompts, penalised, num_scheduler_steps=4,
                                           overlap_steps=overlap)
        assert multi == one_pass  # the penalised request's tokens too, its counts kept on the device
        assert passes[:4] == [1, 4, 4, 4]  # the prefill, then every step of four passes
        assert multi[1] != hf_greedy(llama_dir, prompts[1:2], 10)[0]  # the penalty changed its tokens


def test_streamed_deltas_come_in_groups_and_add_up_to_transformers(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=10, lengths=(9, 30))
    llm = LLM(llama_dir, num_scheduler_steps=4, overlap_steps=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind="delta")
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, params)
    deltas: dict[str, list[list[int]]] = {"s0": [], "s1": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append(out.outputs[0].token_ids)
    assert [sum(deltas[f"s{i}"], []) for i in range(2)] == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    # The first token alone (the prefill), then groups of four and the rest: 1 + 4 * 3 + 3.
    assert [len(d) for d in deltas["s0"]] == [1, 4, 4, 4, 3]
    engine.pool.check_all_free()
    llm.shutdown()


def test_an_abort_between_multi_step_steps_frees_its_blocks(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=12, lengths=(7, 18, 26))
    llm = LLM(llama_dir, num_scheduler_steps=4, block_size=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    engine.step()  # a multi-step step: slots for four tokens each
    out = engine.abort_request("a1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    refs = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert [done["a0"], done["a2"]] == [refs[0], refs[2]]
    engine.pool.check_all_free()
    llm.shutdown()


def test_cost_figures_count_every_pass(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=13, lengths=(5,))
    figures = []
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)  # 16 tokens after the prefill's
    for steps in (1, 4):
        llm = LLM(llama_dir, num_scheduler_steps=steps)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counters = llm.engine.counters
        figures.append((counters.bytes_read, counters.flops, counters.num_steps))
        llm.shutdown()
    (bytes_1, flops_1, steps_1), (bytes_4, flops_4, steps_4) = figures
    assert (steps_1, steps_4) == (17, 5)  # the prefill, then 16 tokens in passes of 4, 4, 4, 4
    assert (bytes_4, flops_4) == (bytes_1, flops_1)  # the same passes, counted in fewer steps


def _run_all(model: str, prompts: list[list[int]], params: list[SamplingParams],
             **options) -> tuple[list[tuple], list[frozenset[str]]]:
    """Each request's tokens, logprobs and their sum; and the requests each step was scheduled
    ahead of the tokens of."""
    llm = LLM(model, **options)
    ahead: list[frozenset[str]] = []
    _record_passes(llm, ahead)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.pool.check_all_free()
    llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in outs], ahead


@pytest.mark.parametrize("overlap", [False, True])
def test_one_pass_steps_of_sampled_decodes_sample_on_the_device_and_are_scheduled_ahead(
        llama_dir: str, overlap: bool) -> None:
    # Seeded sampling with top-p / top-k and logprobs, and min_p with min_tokens holding EOS off:
    # the device's sampler draws what the host's would, and (overlapped) the next step is
    # scheduled on placeholders for them instead of waiting for them on the host.
    prompts = mixed_prompts(seed=9, lengths=(13, 5, 21, 8))
    params = [GREEDY,
              SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=17, max_tokens=11, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=MAX_TOKENS, min_tokens=12),
              GREEDY]
    with host_sampler():
        reference, never_ahead = _run_all(llama_dir, prompts, params, overlap_steps=overlap)
    result, ahead = _run_all(llama_dir, prompts, params, overlap_steps=overlap)
    assert result == reference
    assert result[0][0] == hf_greedy(llama_dir, prompts[:1], MAX_TOKENS)[0]
    assert not any(never_ahead)  # the host sampler's tokens reach the host before the next step
    if overlap:
        assert sum(len(a) == 4 for a in ahead) >= 8  # every request's, sampled ones included
    else:
        assert not any(ahead)


def test_a_penalised_request_keeps_one_pass_steps_from_being_scheduled_ahead(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=9, lengths=(13, 5, 21))
    params = [GREEDY, SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True), GREEDY]
    with host_sampler():
        reference, _ = _run_all(llama_dir, prompts, params, overlap_steps=True)
    result, ahead = _run_all(llama_dir, prompts, params, overlap_steps=True)
    assert result == reference
    # Its penalties read every token so far on the host: only once it has ended are the other
    # two scheduled ahead.
    assert max(len(a) for a in ahead) == 2
