"""Sampling, logprobs, stops, aborts and draft-token slots through the real engine."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.workers.core.request import Request, SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import hf_greedy, hf_logits, mixed_prompts


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def llm(llama_dir: str, request) -> LLM:
    """Every feature with steps run one at a time, and overlapped (scheduled ahead on tokens
    still in flight, as on a GPU)."""
    return LLM(llama_dir, block_size=4, num_kv_blocks=64, overlap_steps=request.param)


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_ids(prompts), params, use_tqdm=False)]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm: LLM) -> None:
    prompts = mixed_prompts(seed=21)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _tokens(llm, prompts[:1], params)[0]
    assert _tokens(llm, prompts[:1], params)[0] == alone
    # In a batch with others (which forces preemption in this 64-block pool), same tokens.
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_ids(prompts[1:]) + _ids(prompts[:1]), [unseeded] * 3 + [params], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    other_seed = _tokens(llm, prompts[:1], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True))
    assert other_seed[0] != alone
    llm.engine.pool.check_all_free()


def test_top_k_one_equals_greedy(llm: LLM, llama_dir: str) -> None:
    prompts = mixed_prompts(seed=22, lengths=(15, 33))
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    assert _tokens(llm, prompts, params) == hf_greedy(llama_dir, prompts, 16)


def test_logprobs_match_transformers(llm: LLM, llama_dir: str) -> None:
    prompt = mixed_prompts(seed=23, lengths=(20,))[0]
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=8, logprobs=3,
                                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(hf_logits(llama_dir, prompt + out.token_ids[:-1]).float(), dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert set(entry) == {token, *top.indices.tolist()}
        for token_id, lp in entry.items():
            assert math.isclose(lp.logprob, row[token_id].item(), abs_tol=1e-4)
        assert entry[token].rank == 1  # greedy picks the most likely token
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                        abs_tol=1e-5)


def test_text_is_the_incremental_decode_of_the_tokens(llm: LLM) -> None:
    outs = llm.generate(["héllo wörld 日本", "The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=30),
                        use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_stop_token_ids_and_stop_strings(llm: LLM, llama_dir: str) -> None:
    prompt = mixed_prompts(seed=24, lengths=(12,))[0]
    ref = hf_greedy(llama_dir, [prompt], 24)[0]
    stop_id = ref[5]
    first = ref.index(stop_id)
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    full = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.index(stop)
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:cut], "stop", stop)
    kept = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True,
                                                       include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == full[:cut + len(stop)]
    llm.engine.pool.check_all_free()


def _with_eos(model_dir: str, tmp_path, eos_id: int) -> str:
    """A copy of the model whose generation_config names eos_id as its EOS."""
    import json
    import shutil

    copy = tmp_path / "eos-model"
    shutil.copytree(model_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}))
    return str(copy)


def test_eos_min_tokens_and_ignore_eos(llama_dir: str, tmp_path) -> None:
    prompt = mixed_prompts(seed=25, lengths=(8,))[0]
    ref = hf_greedy(llama_dir, [prompt], 12)[0]
    eos = ref[3]
    first_eos = ref.index(eos)
    llm = LLM(_with_eos(llama_dir, tmp_path, eos))
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first_eos + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first_eos + 2),
                       use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:first_eos + 2]
    assert out.token_ids[:first_eos] == ref[:first_eos]


def test_abort_at_any_time_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    prompts = mixed_prompts(seed=26)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=1 + i % 2))
    engine.abort_request("abort-3")  # still waiting
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv.pool.num_free_blocks < engine.pool.num_blocks
    out = engine.abort_request("abort-0")  # running
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
        for rid in list(engine.states):
            engine.abort_request(rid)
    engine.pool.check_all_free()
    assert engine.scheduler.num_unfinished == 0


class OracleProposer:
    """Fake proposer: guesses the reference continuation, wrong at every third draft."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.refs, self.k = refs, k
        self.calls = 0

    def propose(self, requests: list[Request]) -> None:
        for req in requests:
            ref = self.refs[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens
            draft = list(ref[done:done + self.k])
            for j in range(len(draft)):
                if (done + j) % 3 == 2:
                    draft[j] = (draft[j] + 1) % 500
            req.spec_token_ids = draft
            self.calls += 1


@pytest.mark.parametrize("k", [1, 3])
def test_draft_tokens_in_lookahead_slots_keep_greedy_output(llama_dir: str, k: int) -> None:
    prompts = mixed_prompts(seed=27)
    refs = hf_greedy(llama_dir, prompts, 24)
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=48, num_lookahead_slots=k, max_num_batched_tokens=32,
              max_num_seqs=4)
    proposer = OracleProposer({tuple(p): r for p, r in zip(prompts, refs)}, k)
    llm.engine.proposer = proposer
    outs = llm.generate(_ids(prompts), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert proposer.calls > 0
    assert 0 < llm.engine.num_accepted_draft_tokens < llm.engine.num_draft_tokens
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize(("options", "field"), [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 3}, "block_size"),
    ({"dtype": "float64"}, "dtype"),
    ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"max_model_len": 10**6}, "max_model_len"),
    ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_bad_engine_options_name_the_field(llama_dir: str, options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        LLM(llama_dir, **options)


@pytest.mark.parametrize(("params", "field"), [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_name_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**params)


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate(_ids([[]]), use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt: token id 600"):
        llm.generate(_ids([[1, 600]]), use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt:.*KV blocks"):
        llm.generate(_ids([[7] * 300]), use_tqdm=False)
    assert len(llm.generate(["still fine"], SamplingParams(max_tokens=3), use_tqdm=False)) == 1
    llm.engine.pool.check_all_free()


def test_bfloat16_on_cpu_generates(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=28, lengths=(10, 30))
    outs = LLM(llama_dir, dtype="bfloat16").generate(_ids(prompts), SamplingParams(temperature=0.0, max_tokens=8,
                                                                                   ignore_eos=True), use_tqdm=False)
    refs = hf_greedy(llama_dir, prompts, 8)
    # bf16 rounding may flip a late near-tie, but the first tokens of a decisive model agree.
    assert [o.outputs[0].token_ids[:2] for o in outs] == [r[:2] for r in refs]


def test_prompt_logprobs_match_transformers_across_chunks(llama_dir: str) -> None:
    # A 16-token budget splits the 40-token prompt over three steps; a cached prefix is skipped
    # for such requests, since every prompt position must be scored.
    llm = LLM(llama_dir, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = mixed_prompts(seed=31, lengths=(40,))[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)  # cache it
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    ref = torch.log_softmax(hf_logits(llama_dir, prompt).float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[i], ref[i - 1]
        assert set(entry) == {prompt[i], *row.topk(2).indices.tolist()}
        assert math.isclose(entry[prompt[i]].logprob, row[prompt[i]].item(), abs_tol=1e-4)
        assert entry[prompt[i]].rank == 1 + int((row > row[prompt[i]]).sum())
    llm.engine.pool.check_all_free()
