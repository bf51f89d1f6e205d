"""What only a GPU can check: CUDA-graph capture and replay, the kernels compiled for real,
KV sizing by profiling and memory given back at shutdown. Skipped without CUDA."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from tandem.workers.core.request import SamplingParams
from tandem.workers.llm import LLM
from tests.conftest import (
    ARCHITECTURES,
    MIXED_SCHEDULE_PROMPTS,
    MIXED_SCHEDULE_STEPS,
    hf_greedy,
    host_sampler,
    mixed_prompts,
    tiny_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_equals_transformers_with_graphs_on_and_off(arch: str, enforce_eager: bool) -> None:
    model = tiny_model(arch)
    prompts = mixed_prompts()
    llm = LLM(model, device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=16,
              gpu_memory_utilization=0.3)
    runner = llm.engine.executor.runner
    if enforce_eager:
        assert runner.graphs is None
    else:
        assert sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16]  # every bucket captured
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_overlapped_steps_with_graphs_match(llama_dir: str) -> None:
    prompts = mixed_prompts(seed=3)
    llm = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    assert llm.engine.overlap_steps  # on by default on CUDA
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm.shutdown()


@pytest.mark.parametrize("mixed_step_graphs", [True, False])
def test_mixed_steps_replay_their_graphs_and_match(llama_dir: str, mixed_step_graphs: bool) -> None:
    # The shared mixed schedule (tests/conftest.py), which tests/model/test_gpu_path.py runs on
    # CPU through the padded buckets: each of its mixed steps replays its bucket's graph, the
    # first a lone chunk that scores nothing but writes its KV.
    prompts = mixed_prompts(**MIXED_SCHEDULE_PROMPTS)
    llm = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3, mixed_step_graphs=mixed_step_graphs)
    runner = llm.engine.executor.runner
    replays: list[tuple[int, int]] = []
    if mixed_step_graphs:
        assert sorted(runner.mixed_graphs.graphs) == [16, 32, 48, 64]  # every bucket captured
        run = runner.mixed_graphs.run

        def counted(inputs):
            replays.append((inputs.graph_tokens, len(inputs.meta.prefills)))
            return run(inputs)

        runner.mixed_graphs.run = counted
    else:
        assert runner.mixed_graphs is None
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert replays == ([(bucket, chunks) for bucket, _, chunks in MIXED_SCHEDULE_STEPS] if mixed_step_graphs else [])
    llm.engine.pool.check_all_free()
    llm.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_multi_step_decoding_with_graphs_on_and_off_matches(llama_dir: str, enforce_eager: bool) -> None:
    # Every pass of a step launched before any token comes back: replays read their inputs from
    # the graph's buffer, each written by a copy queued behind the replay before it.
    prompts = mixed_prompts(seed=5)
    llm = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3,
              num_scheduler_steps=8, enforce_eager=enforce_eager)
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_multi_step_steps_scheduled_ahead_with_a_sampled_request(llama_dir: str) -> None:
    # Each multi-step step is scheduled ahead of the last one's tokens; the sampled row's
    # parameters go up through pinned memory while that step still runs.
    prompts = mixed_prompts(seed=6)
    llm = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3,
              num_scheduler_steps=4)
    assert llm.engine.overlap_steps
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [sampled] + [GREEDY] * (len(prompts) - 1),
                        use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[1:] == hf_greedy(llama_dir, prompts[1:], MAX_TOKENS)
    assert len(tokens[0]) == MAX_TOKENS and outs[0].outputs[0].finish_reason == "length"
    # A penalised request and logprobs, taken on the device pass by pass: the same as one pass a step.
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2,
                               max_tokens=MAX_TOKENS, ignore_eos=True)
    # The fraction bounds the card's whole use, the first engine's 0.3 included.
    one_pass = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], penalised, use_tqdm=False)
    tokens.append([o.outputs[0].token_ids for o in outs])
    with host_sampler():
        outs = one_pass.generate([{"prompt_token_ids": p} for p in prompts], penalised, use_tqdm=False)
    tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[-2] == tokens[-1]
    one_pass.shutdown()
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_one_pass_sampled_decodes_on_the_device_match_the_host_sampler(llama_dir: str) -> None:
    # One pass a step, overlapped, graphs on: steps of decodes with a seeded sampled row (and
    # logprobs) sample on the device and are scheduled ahead; the host sampler gives the same.
    prompts = mixed_prompts(seed=7)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True,
                             logprobs=2)
    params = [sampled] + [GREEDY] * (len(prompts) - 1)
    llm = LLM(llama_dir, device="cuda", dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    assert llm.engine.overlap_steps and llm.engine.executor.runner.graphs is not None
    results = []
    for host in (False, True):
        with host_sampler() if host else contextlib.nullcontext():
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
    assert [tokens for tokens, _ in results[0][1:]] == hf_greedy(llama_dir, prompts[1:], MAX_TOKENS)
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_kv_cache_sized_by_profiling_and_given_back(llama_dir: str) -> None:
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    first = LLM(llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.5)
    runner = first.engine.executor.runner
    assert runner.activation_bytes > 0
    total = torch.cuda.mem_get_info()[1]
    assert torch.cuda.mem_get_info()[0] < free_before - 0.2 * total  # the KV cache took its share
    first.shutdown()
    del first, runner
    gc.collect()
    assert torch.cuda.mem_get_info()[0] > free_before - 0.02 * total  # everything came back
    # A second engine at the same fraction fits again, and so does one after a dropped reference.
    second = LLM(llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.5)
    del second
    third = LLM(llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.5)
    assert _generate(third, mixed_prompts(lengths=(9,))) == hf_greedy(llama_dir, mixed_prompts(lengths=(9,)),
                                                                        MAX_TOKENS)
    third.shutdown()


def test_bfloat16_graph_and_eager_agree(llama_dir: str) -> None:
    """bf16 on GPU: graph replay and eager launches run the same kernels, so the same tokens."""
    prompts = mixed_prompts(seed=8)
    outs = []
    for eager in (False, True):
        llm = LLM(llama_dir, device="cuda", dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.3)
        outs.append(_generate(llm, prompts))
        llm.shutdown()
    assert outs[0] == outs[1]


def test_every_pipeline_stage_captures_its_own_decode_graphs(monkeypatch) -> None:
    """PP = 2, both stages in this process (tests/stage_chain.py): each captures every bucket of
    its own layers (stage 1 from its hidden-state buffer), and greedy output equals transformers."""
    from tests.stage_chain import use_stage_chain

    use_stage_chain(monkeypatch, "cuda")
    model = tiny_model("llama", num_hidden_layers=2)
    prompts = mixed_prompts()
    llm = LLM(model, device="cuda", dtype="float32", pipeline_parallel_size=2, max_num_seqs=16,
              num_kv_blocks=256)
    runners = llm.engine.executor.runners
    assert [sorted(r.graphs.graphs) for r in runners] == [[1, 2, 4, 8, 16]] * 2
    assert [r.graphs.hidden_in is not None for r in runners] == [False, True]
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
    llm.engine.pool.check_all_free()
    llm.shutdown()
