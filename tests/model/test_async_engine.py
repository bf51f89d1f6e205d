"""AsyncEngine: per-request streams on a thread, delta merging and the stream interval."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.workers.async_engine import AsyncEngine, merge_deltas
from tandem.workers.core.request import CompletionOutput, RequestOutput, SamplingParams
from tandem.workers.llm import build_engine
from tests.conftest import hf_greedy, mixed_prompts


def test_merge_deltas_concatenates_each_sequence_and_keeps_the_latest_state():
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "he", [5], None), CompletionOutput(1, "x", [7], None)])
    b = RequestOutput("r", None, [1], [CompletionOutput(0, "llo", [6], None, finish_reason="length")],
                      finished=False, num_cached_tokens=4)
    m = merge_deltas(a, b)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in m.outputs] == [
        (0, "hello", [5, 6], "length"), (1, "x", [7], None)]
    assert m.num_cached_tokens == 4


@pytest.fixture(scope="module")
def engine(llama_dir: str):
    from tandem.workers.config import EngineConfig

    eng = AsyncEngine(build_engine(EngineConfig.from_options(model=llama_dir, num_kv_blocks=64, block_size=4),
                                   show_progress=False))
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncEngine, prompt: list[int], interval_s: float) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [out async for out in engine.generate({"prompt_token_ids": prompt}, params, f"r{interval_s}",
                                                 stream_interval_s=interval_s)]


def test_stream_interval_sends_fewer_larger_deltas_with_the_same_tokens(engine, llama_dir: str):
    prompt = mixed_prompts(seed=41, lengths=(12,))[0]
    every = asyncio.run(_collect(engine, prompt, 0.0))
    # The engine waits after the step that delivers the first token until the consumer holds
    # it, so how soon this machine wakes the consumer cannot change what the first delta holds.
    first_held = threading.Event()
    base = engine.engine.scheduler.num_generated_tokens

    def hold_after_first_token(eng) -> None:
        if eng.scheduler.num_generated_tokens > base and not first_held.is_set():
            first_held.wait(60)

    engine.add_step_listener(hold_after_first_token)

    async def collect_batched() -> list[RequestOutput]:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        deltas = []
        async for out in engine.generate({"prompt_token_ids": prompt}, params, "r-batched", stream_interval_s=30.0):
            deltas.append(out)
            first_held.set()
        return deltas

    batched = asyncio.run(collect_batched())
    expected = hf_greedy(llama_dir, [prompt], 24)[0]
    for deltas in (every, batched):
        assert [t for d in deltas for t in d.outputs[0].token_ids] == expected
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    # The first token is never held back for the interval; the other 23 wait for it, and the
    # finish ends the wait (a 30 s interval would otherwise hold them).
    assert [len(d.outputs[0].token_ids) for d in batched] == [1, 23]
    assert len(every) > 2
    engine.engine.pool.check_all_free()


def test_multi_step_streams_concurrent_requests_to_their_greedy_tokens(llama_dir: str):
    from tandem.workers.config import EngineConfig

    engine = AsyncEngine(build_engine(EngineConfig.from_options(model=llama_dir, num_kv_blocks=64, block_size=4,
                                                                num_scheduler_steps=4), show_progress=False))
    prompts = mixed_prompts(seed=42, lengths=(12, 30))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def stream(i: int) -> list[list[int]]:
        return [out.outputs[0].token_ids async for out in engine.generate(
            {"prompt_token_ids": prompts[i]}, params, f"ms{i}", stream_interval_s=0.0)]

    async def both() -> list[list[list[int]]]:
        return await asyncio.gather(stream(0), stream(1))

    try:
        deltas = asyncio.run(both())
        assert [sum(d, []) for d in deltas] == hf_greedy(llama_dir, prompts, 24)
        assert max(len(d) for d in deltas[0]) > 1  # tokens came several a step
        engine.engine.pool.check_all_free()
    finally:
        engine.shutdown()
