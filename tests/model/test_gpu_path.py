"""The GPU fast path, checked where it runs: the Triton kernels (interpreted on CPU, compiled on
CUDA), decode batches padded to graph buckets, and steps overlapped with the host's work.
Greedy output must equal transformers through every one of them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.workers.core.request import SamplingParams  # noqa: E402
from tandem.workers.llm import LLM  # noqa: E402
from tandem.workers.runner import model_runner  # noqa: E402
from tandem.workers.runner.model_runner import ModelRunner  # noqa: E402
from tandem.workers.runner.step_inputs import advance_decodes  # noqa: E402
from tests.conftest import (  # noqa: E402
    ARCHITECTURES,
    MIXED_SCHEDULE_PROMPTS,
    MIXED_SCHEDULE_STEPS,
    hf_greedy,
    mixed_prompts,
    tiny_model,
)

pytestmark = pytest.mark.slow  # the engine through Triton's interpreter: not in the fast loop

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def llama_dir() -> str:
    """One layer: every kernel launch a step makes, at half the interpreter's time of two."""
    return tiny_model("llama", num_hidden_layers=1)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(model: str, **options) -> LLM:
    return LLM(model, device=DEVICE, dtype="float32", attention_backend="triton", **options)


@pytest.fixture
def padded_graphs(monkeypatch):
    """Decode steps go through the graph runner's buckets and buffer, eagerly (no capture on CPU)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(ModelRunner, "_graph_mode", lambda self: "eager")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_triton_kernels_equal_transformers(arch: str) -> None:
    model = tiny_model(arch, num_hidden_layers=1)
    prompts = mixed_prompts(lengths=(3, 17, 40))
    # A 16-token budget mixes prefill chunks (reading their cached prefix) with decodes.
    llm = _llm(model, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_triton_sliding_window_equals_transformers() -> None:
    model = tiny_model("mistral", sliding_window=12, num_hidden_layers=1)
    prompts = mixed_prompts(seed=11, lengths=(30, 7))
    llm = _llm(model, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
    llm.shutdown()


def test_padded_decode_batches_equal_transformers(llama_dir: str, padded_graphs) -> None:
    prompts = mixed_prompts(seed=2, lengths=(5, 9, 21))  # 3 decodes pad to the bucket of 4
    llm = _llm(llama_dir, max_num_seqs=8, block_size=4)
    runner = llm.engine.executor.runner
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8]
    seen: list[tuple[int | None, int]] = []
    build = runner.builder.build

    def record(out, states, table, graph=None, source=None, **kwargs):
        inputs = build(out, states, table, graph, source, **kwargs)
        seen.append((inputs.graph_batch, len(inputs.req_ids)))
        return inputs

    runner.builder.build = record
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert (4, 3) in seen  # three decodes ran padded to the bucket of four
    assert (None, 3) in seen  # the prefill step ran eagerly, unpadded
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_sequences_past_the_capture_length_decode_eagerly(llama_dir: str, padded_graphs) -> None:
    prompts = mixed_prompts(seed=3, lengths=(4, 30))
    llm = _llm(llama_dir, max_num_seqs=4, block_size=4, max_seq_len_to_capture=20)
    runner = llm.engine.executor.runner
    assert runner.graphs.width == 6  # (20 + 1) tokens in blocks of 4
    seen: list[tuple[int | None, int]] = []
    build = runner.builder.build

    def record(out, states, table, graph=None, source=None, **kwargs):
        inputs = build(out, states, table, graph, source, **kwargs)
        seen.append((inputs.graph_batch, max(inputs.meta.decode_seq_lens or [0])))
        return inputs

    runner.builder.build = record
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert all(length <= 20 for batch, length in seen if batch is not None)  # graphs: short contexts only
    assert any(batch is None and length > 20 for batch, length in seen)  # the 30-token prompt's decodes
    llm.shutdown()


def test_overlapped_steps_equal_transformers(llama_dir: str, padded_graphs) -> None:
    prompts = mixed_prompts(seed=4, lengths=(6, 30))
    llm = _llm(llama_dir, overlap_steps=True, block_size=4)
    assert llm.engine.overlap_steps
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_mixed_steps_past_max_mixed_graph_tokens_run_eagerly(llama_dir: str, padded_graphs) -> None:
    """With the mixed graphs capped at 32 tokens under a 48-token budget, steps of 33-48 tokens
    launch eagerly, smaller ones pad to the buckets, and the output is the same."""
    prompts = mixed_prompts(seed=21, lengths=(60, 3, 30, 9, 5))
    llm = _llm(llama_dir, max_num_seqs=4, max_num_batched_tokens=48, block_size=4, overlap_steps=True,
               max_mixed_graph_tokens=32)
    runner = llm.engine.executor.runner
    assert runner.mixed_graphs.buckets == [16, 32]
    seen: list[tuple[int | None, int]] = []
    build = runner.builder.build

    def record(out, states, table, graph=None, source=None, **kwargs):
        inputs = build(out, states, table, graph, source, **kwargs)
        if inputs.meta.prefills:
            seen.append((inputs.graph_tokens, out.total_num_scheduled_tokens))
        return inputs

    runner.builder.build = record
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert seen[0] == (None, 48)  # the first chunk: past the largest bucket
    assert {tokens for tokens, real in seen if real > 32} == {None}
    assert {tokens for tokens, real in seen if real <= 32} <= {16, 32} and any(real <= 32 for _, real in seen)
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_mixed_steps_through_padded_mixed_buckets_equal_transformers(llama_dir: str, padded_graphs) -> None:
    # The shared mixed schedule (tests/conftest.py), steps scheduled ahead on the last step's
    # tokens: every mixed step pads to its bucket (the last from 27 tokens to 32), the first a
    # lone chunk that scores nothing (its graph still writes its KV).
    # tests/gpu/test_cuda_graphs.py replays the same schedule through captured graphs.
    prompts = mixed_prompts(**MIXED_SCHEDULE_PROMPTS)
    llm = _llm(llama_dir, max_num_seqs=4, max_num_batched_tokens=64, overlap_steps=True)
    runner = llm.engine.executor.runner
    assert runner.mixed_graphs.buckets == [16, 32, 48, 64]
    seen: list[tuple[int | None, int | None, int, int]] = []
    build = runner.builder.build

    def record(out, states, table, graph=None, source=None, **kwargs):
        inputs = build(out, states, table, graph, source, **kwargs)
        seen.append((inputs.graph_tokens, inputs.graph_batch, out.total_num_scheduled_tokens,
                     len(inputs.meta.prefills)))
        return inputs

    runner.builder.build = record
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert [(tokens, real, chunks) for tokens, _, real, chunks in seen if chunks] == MIXED_SCHEDULE_STEPS
    decodes = [(tokens, batch) for tokens, batch, _, chunks in seen if not chunks]
    assert {tokens for tokens, _ in decodes} == {None}
    assert {batch for _, batch in decodes} == {1, 2, 4}  # pure decode steps: the decode buckets
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_ngram_speculation_through_the_varlen_kernel() -> None:
    # Verification steps score 1 + k tokens per request: the variable-length kernel's rows. Two
    # layers: the one-layer model's output never repeats the prompt, so nothing would be drafted.
    model = tiny_model("llama")
    base = mixed_prompts(seed=6, lengths=(10,))[0]
    prompts = [base * 3]
    llm = _llm(model, speculative_model="ngram", num_speculative_tokens=3, block_size=4)
    assert _generate(llm, prompts) == hf_greedy(model, prompts, MAX_TOKENS)
    assert llm.engine.num_draft_tokens > 0
    llm.shutdown()


def test_multi_step_passes_through_padded_graphs_equal_transformers(llama_dir: str, padded_graphs,
                                                                   monkeypatch) -> None:
    # Three decodes pad to the bucket of 4; the 17-token prompt's passes cross the capture
    # length (20) inside a step, so that step's last pass leaves the graphs and runs eagerly.
    prompts = mixed_prompts(seed=14, lengths=(5, 9, 17))
    llm = _llm(llama_dir, max_num_seqs=8, block_size=4, num_scheduler_steps=4, overlap_steps=True,
               max_seq_len_to_capture=20)
    runner = llm.engine.executor.runner
    seen: list[tuple[str, int | None, int]] = []
    build = runner.builder.build

    def record(out, states, table, graph=None, source=None, advance=0, passes_after=0):
        inputs = build(out, states, table, graph, source, advance, passes_after)
        seen.append(("build", inputs.graph_batch, advance))
        return inputs

    def moved(inputs, tokens, block_size):
        seen.append(("advance", inputs.graph_batch, None))
        advance_decodes(inputs, tokens, block_size)

    scheduler, ahead = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def scheduled(pending=frozenset(), max_steps=1, num_ahead=1, *slots):
        out = schedule(pending, max_steps, num_ahead, *slots)
        ahead.append((len(pending), num_ahead, out.num_steps))
        return out

    scheduler.schedule = scheduled
    runner.builder.build = record
    monkeypatch.setattr(model_runner, "advance_decodes", moved)
    assert _generate(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    # Overlapped: each step scheduled ahead on the one before it, a multi-step step on the last
    # pass's tokens of another (the prefill; 4 passes on its tokens; 4 on those; 4 more, of
    # which the first 3 are the last tokens of all).
    assert ahead[:4] == [(0, 1, 1), (3, 1, 4), (3, 4, 4), (3, 4, 4)]
    # The first multi-step step: passes 1-3 replay the bucket of four, their inputs moved on in
    # place; the 4th (context 20) is built again, eagerly.
    assert seen[1:5] == [("build", 4, 0), ("advance", 4, None), ("advance", 4, None), ("build", None, 3)]
    # Later steps run eagerly from their first pass, moved on in place.
    assert seen[5:9] == [("build", None, 0)] + [("advance", None, None)] * 3
    llm.engine.pool.check_all_free()
    llm.shutdown()


def test_prompt_logprobs_beside_padded_graph_decodes(llama_dir: str, padded_graphs) -> None:
    # A 4-token budget beside three decodes: the prompt-logprobs request's prompt comes one token
    # a step, shaped like a decode step, whose logits must score the next prompt token (eager);
    # once its prompt is scored its decodes join the graph buckets.
    prompts = mixed_prompts(seed=17, lengths=(5, 6, 7, 9))
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                            prompt_logprobs=1)]
    runs = []
    for options in ({}, {"attention_backend": "torch"}):
        llm = LLM(llama_dir, device=DEVICE, dtype="float32", block_size=4, max_num_seqs=4,
                  max_num_batched_tokens=4, **{"attention_backend": "triton", **options})
        graphs: list[tuple[int | None, bool, int]] = []
        llm.engine.executor.runner.builder.build = _recording(llm.engine.executor.runner.builder.build, graphs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], outs[3].prompt_logprobs, graphs))
        llm.shutdown()
    (tokens, prompt_lps, graphs), (ref_tokens, ref_lps, _) = runs
    assert tokens == ref_tokens == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    # The torch backend's attention rounds differently: the same entries and ranks, logprobs to 1e-4.
    assert len(prompt_lps) == 9 and prompt_lps[0] is None is ref_lps[0]
    for entry, ref in zip(prompt_lps[1:], ref_lps[1:]):
        assert {t: lp.rank for t, lp in entry.items()} == {t: lp.rank for t, lp in ref.items()}
        assert all(abs(entry[t].logprob - ref[t].logprob) < 1e-4 for t in ref)
    # Steps scoring prompt positions ran eagerly, four of them shaped like decode steps; decode
    # steps of the same requests went through the buckets.
    assert all(batch is None for batch, scored, _ in graphs if scored)
    assert sum(1 for _, scored, rows in graphs if scored and rows == 4) >= 4
    assert any(batch is not None for batch, _, _ in graphs)


def _recording(build, graphs: list[tuple[int | None, bool, int]]):
    """`build`, noting each step's graph bucket, whether it scores prompt positions, and its rows."""
    def record(*args, **kwargs):
        inputs = build(*args, **kwargs)
        graphs.append((inputs.graph_batch, bool(inputs.prompt_rows), len(inputs.req_ids)))
        return inputs
    return record
