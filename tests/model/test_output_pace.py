"""A paced request (workers/core/output_pace.py) through the real engine: its first token goes at
once, then at most one output per interval, which says everything since the one before; what
the outputs say together is exactly what an unpaced request's say."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import RequestOutput, SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, mixed_prompts

FOREVER = 1e9  # an interval no test outlives: only the first token and the finish go out


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def llm(llama_dir: str, request) -> LLM:
    return LLM(llama_dir, block_size=4, num_kv_blocks=64, overlap_steps=request.param)


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams, OutputPace | None]],
         each_step=lambda outputs: None) -> dict[str, list[RequestOutput]]:
    engine = llm.engine
    for request_id, (prompt, params, pace) in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params, pace)
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished_requests():
        step = engine.step()
        each_step(step)
        for out in step:
            outputs[out.request_id].append(out)
    engine.pool.check_all_free()
    return outputs


def _said(deltas: list[RequestOutput], index: int = 0) -> tuple[str, list[int], list | None, str | None]:
    """What a request's delta outputs say together for one sequence."""
    parts = [o for d in deltas for o in d.outputs if o.index == index]
    logprobs = None if parts[0].logprobs is None else [lp for o in parts for lp in o.logprobs]
    return "".join(o.text for o in parts), [t for o in parts for t in o.token_ids], logprobs, parts[-1].finish_reason


def _delta(params: SamplingParams) -> SamplingParams:
    return replace(params, output_kind="delta")


def test_a_paced_request_says_its_first_token_at_once_and_the_rest_when_it_ends(llm: LLM, llama_dir: str) -> None:
    prompts = mixed_prompts(seed=61, lengths=(7, 30))
    params = _delta(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    out = _run(llm, {"every": (prompts[0], params, None), "paced": (prompts[0], params, OutputPace(FOREVER)),
                     "other": (prompts[1], params, OutputPace(0.0))})
    expected = hf_greedy(llama_dir, prompts, 20)
    assert _said(out["every"])[1] == _said(out["paced"])[1] == expected[0]
    assert _said(out["other"])[1] == expected[1]
    assert _said(out["paced"])[0] == _said(out["every"])[0]
    with_tokens = [d for d in out["paced"] if d.outputs[0].token_ids]
    # The first token alone, at once; the other 19 wait in the engine until the finish.
    assert [len(d.outputs[0].token_ids) for d in with_tokens] == [1, 19]
    assert with_tokens[-1].finished and not any(d.finished for d in out["paced"][:-1])
    assert len(out["paced"]) < len(out["every"])
    # A pace of 0 is every step, like none.
    assert [len(d.outputs[0].token_ids) for d in out["other"] if d.outputs[0].token_ids] == [1] * 20


def test_a_pace_changed_while_its_requests_run_holds_from_the_next_step(llm: LLM) -> None:
    prompt = mixed_prompts(seed=62, lengths=(9,))[0]
    params = _delta(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    pace = OutputPace(FOREVER)
    every = _run(llm, {"every": (prompt, params, None)})["every"]
    base = llm.engine.scheduler.num_generated_tokens

    def release_after_eight(outputs: list[RequestOutput]) -> None:
        if llm.engine.scheduler.num_generated_tokens - base >= 8:
            pace.interval_s = 0.0  # the channel's streams got fewer: every step again

    paced = _run(llm, {"paced": (prompt, params, pace)}, release_after_eight)["paced"]
    assert _said(paced)[:2] == _said(every)[:2]
    counts = [len(d.outputs[0].token_ids) for d in paced if d.outputs[0].token_ids]
    assert counts[0] == 1 and counts[1] > 1  # the held tokens come as one output
    assert counts[2:] == [1] * len(counts[2:]) and sum(counts) == 24


def test_held_outputs_join_text_logprobs_stop_strings_and_every_sequence_exactly(llm: LLM) -> None:
    prompts = mixed_prompts(seed=63, lengths=(11, 25))
    base = _run(llm, {"probe": (prompts[0], _delta(SamplingParams(temperature=0.0, max_tokens=16,
                                                                  ignore_eos=True)), None)})["probe"]
    text = _said(base)[0]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # ends the request mid-way, across held steps
    cases = {
        "logprobs": SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True, prompt_logprobs=1),
        "n2": SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=12, ignore_eos=True, logprobs=1),
        "stop": SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True),
    }
    for name, params in cases.items():
        params = _delta(params)
        every = _run(llm, {name: (prompts[0], params, None), "beside": (prompts[1], params, None)})
        paced = _run(llm, {name: (prompts[0], params, OutputPace(FOREVER)),
                           "beside": (prompts[1], params, OutputPace(FOREVER))})
        for request_id in (name, "beside"):
            for index in range(params.n):
                a, b = _said(every[request_id], index), _said(paced[request_id], index)
                assert a[:2] == b[:2] and a[3] == b[3], (name, request_id, index)
                if a[2] is not None:
                    assert [sorted((t, lp.logprob, lp.decoded_token) for t, lp in e.items()) for e in a[2]] == \
                        [sorted((t, lp.logprob, lp.decoded_token) for t, lp in e.items()) for e in b[2]]
            prompt_lps = [d.prompt_logprobs for d in paced[request_id] if d.prompt_logprobs is not None]
            assert len(prompt_lps) == (1 if params.prompt_logprobs is not None else 0)
        assert len(paced[name]) < len(every[name])
    assert _said(_run(llm, {"s": (prompts[0], _delta(cases["stop"]), OutputPace(FOREVER))})["s"])[3] == "stop"


def test_an_aborted_paced_request_says_what_it_held_and_frees_its_blocks(llm: LLM) -> None:
    prompt = mixed_prompts(seed=64, lengths=(13,))[0]
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompt},
                       _delta(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)), OutputPace(FOREVER))
    said: list[RequestOutput] = []
    base = engine.scheduler.num_generated_tokens
    while engine.scheduler.num_generated_tokens - base < 6:
        said += engine.step()
    last = engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    said.append(last)
    assert last.finished and last.outputs[0].finish_reason == "abort"
    token_ids = _said(said)[1]
    assert len(token_ids) >= 6 and len([d for d in said if d.outputs[0].token_ids]) == 2
    engine.pool.check_all_free()
