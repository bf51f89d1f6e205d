"""AsyncEngine: per-request streams on a thread, delta merging and the stream interval."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.workers.core.request import CompletionOutput, RequestOutput, SamplingParams
from tandem.workers.engine.async_engine import AsyncEngine, merge_deltas
from tandem.workers.engine.builder import build_engine
from tests.conftest import hf_greedy, mixed_prompts, wait_for


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


def _hold_after_next_token(engine: AsyncEngine) -> tuple[threading.Event, threading.Event]:
    """(held, release): after the step that delivers the next token it generates, the engine
    sets `held` and waits until `release` is set, so what a test does at that point (take the
    first delta, leave the request) cannot race the engine, however fast or slow the machine.
    Once released, the listener stays registered and does nothing."""
    held, release = threading.Event(), threading.Event()
    base = engine.engine.scheduler.num_generated_tokens

    def hold(eng) -> None:
        if eng.scheduler.num_generated_tokens > base and not release.is_set():
            held.set()
            release.wait(60)

    engine.add_step_listener(hold)
    return held, release


def test_stream_interval_sends_fewer_larger_deltas_with_the_same_tokens(engine, llama_dir: str):
    prompt = mixed_prompts(seed=41, lengths=(12,))[0]
    every = asyncio.run(_collect(engine, prompt, 0.0))
    # The consumer holds the first delta before the engine goes on, so how soon this machine
    # wakes it cannot change what that delta holds.
    _, first_held = _hold_after_next_token(engine)

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
    # (Without the interval the count of deltas is the machine's: the deltas waiting when the
    # consumer's loop wakes merge into one, so a busy machine may give one delta for all 24.)
    assert [len(d.outputs[0].token_ids) for d in batched] == [1, 23]
    engine.engine.pool.check_all_free()


def test_final_only_gives_one_output_with_what_the_deltas_add_up_to(engine, llama_dir: str):
    prompts = mixed_prompts(seed=43, lengths=(12, 7))
    expected = hf_greedy(llama_dir, prompts, 24)

    async def run(prompt: list[int], request_id: str, final_only: bool, **params) -> list[RequestOutput]:
        sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **params)
        return [out async for out in engine.generate({"prompt_token_ids": prompt}, sampling, request_id,
                                                     final_only=final_only)]

    async def both() -> list[list[RequestOutput]]:
        return await asyncio.gather(run(prompts[0], "whole", True), run(prompts[0], "deltas", False),
                                    run(prompts[1], "whole-n2", True, n=2, logprobs=1))

    whole, deltas, pair = asyncio.run(both())
    [out] = whole
    assert out.finished and out.outputs[0].token_ids == expected[0]
    assert sum((d.outputs[0].token_ids for d in deltas), []) == expected[0]
    assert out.outputs[0].text == "".join(d.outputs[0].text for d in deltas)
    assert out.outputs[0].finish_reason == deltas[-1].outputs[0].finish_reason == "length"
    [two] = pair
    assert [c.token_ids for c in two.outputs] == [expected[1], expected[1]]
    assert [len(c.logprobs) for c in two.outputs] == [24, 24]
    # A stop string needs the text as it grows: it still ends the request at the right place.
    # (Two characters of the text from its middle on, not a delta's: how many deltas there are,
    # and what each holds, is the machine's, since waiting deltas merge.)
    text = out.outputs[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip() and text.index(text[i:i + 2]) > 0)
    [stopped] = asyncio.run(run(prompts[0], "stop", True, stop=[stop]))
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].text == text[:text.index(stop)]
    engine.engine.pool.check_all_free()


def test_leaving_a_final_only_request_before_it_ends_aborts_it(engine):
    prompt = mixed_prompts(seed=44, lengths=(9,))[0]
    # The engine holds after the request's first token until the caller has left, so the
    # request cannot finish first however fast this machine is.
    held, left = _hold_after_next_token(engine)
    base = engine.engine.scheduler.num_generated_tokens

    async def leave_early() -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(anext(engine.generate({"prompt_token_ids": prompt}, sampling, "left",
                                                           final_only=True)))
        while not held.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(leave_early())
    finally:
        left.set()
    wait_for(lambda: not engine.engine.has_unfinished_requests(), timeout_s=30)
    assert engine.engine.scheduler.num_generated_tokens - base < 200
    engine.engine.pool.check_all_free()


def test_a_stream_holding_its_first_token_finds_the_step_that_made_it_counted(engine, monkeypatch):
    """`last_stats` (the KV report's and the router's figures) is taken before a step's outputs
    go out: a slow `stats()` would otherwise let the client read the idle engine's figures."""
    import time

    fast = engine.engine.stats

    def slow() -> dict:
        time.sleep(0.05)
        return fast()

    monkeypatch.setattr(engine.engine, "stats", slow)
    wait_for(lambda: engine.last_stats["num_running"] == 0, timeout_s=30)

    async def running_at_each_delta() -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        return [engine.last_stats["num_running"]
                async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "counted")]

    assert asyncio.run(running_at_each_delta()) == [1, 1, 0]


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


def test_a_step_that_hangs_shows_as_the_time_it_has_run(engine):
    """What the stall watchdog reads (GroupServer.check_health): nothing fails while a device
    hangs or a worker is stopped, but the running step's age grows."""
    from unittest import mock

    entered, release, hanging_step = _hanging(engine)

    async def run() -> float:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        task = asyncio.create_task(_drain(engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "hung")))
        assert await asyncio.to_thread(entered.wait, 60)
        await asyncio.sleep(0.05)
        running = engine.step_running_for()
        release.set()
        await task
        return running

    assert engine.step_running_for() == 0.0
    with mock.patch.object(engine.engine, "step", hanging_step):
        running = asyncio.run(run())
    assert running >= 0.05 and engine.step_running_for() == 0.0


def _hanging(engine: AsyncEngine):
    """(entered, release, a step that hangs): the step sets `entered`, then waits for `release`
    (at most 60 s) before it runs, as a stopped worker or a hung device holds it."""
    entered, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def hanging_step():
        entered.set()
        release.wait(60)
        return real_step()

    return entered, release, hanging_step


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass


def test_a_stalled_engine_fails_its_requests_at_once_and_takes_no_more(llama_dir: str):
    """`fail_stalled` (the stall watchdog's, from another thread than the hung engine's): every
    request in flight ends with the error now, a new one is refused at once, and the step that
    comes back later delivers to no one."""
    from unittest import mock

    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.engine_dead import EngineDeadError

    engine = AsyncEngine(build_engine(EngineConfig.from_options(model=llama_dir, num_kv_blocks=64, block_size=4),
                                      show_progress=False))
    entered, release, hanging_step = _hanging(engine)

    async def run() -> list:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        streamed = asyncio.create_task(_drain(engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "a")))
        submitted: asyncio.Future = asyncio.get_running_loop().create_future()
        engine.submit({"prompt_token_ids": [8, 9]}, params, "b",
                      lambda item: submitted.done() or submitted.set_result(item))
        assert await asyncio.to_thread(entered.wait, 60)
        await asyncio.sleep(0.05)  # both taken in before the step hung
        engine.fail_stalled("stuck")
        with pytest.raises(EngineDeadError, match="^stuck$"):
            await asyncio.wait_for(streamed, 5)
        got_b = await asyncio.wait_for(submitted, 5)
        refused: asyncio.Future = asyncio.get_running_loop().create_future()
        engine.submit({"prompt_token_ids": [1, 2]}, params, "c", refused.set_result)
        got_c = await asyncio.wait_for(refused, 5)
        release.set()  # the step comes back: its outputs have no stream left
        await asyncio.sleep(0.2)
        return [type(got_b).__name__, str(got_b), type(got_c).__name__, str(got_c)]

    try:
        with mock.patch.object(engine.engine, "step", hanging_step):
            assert asyncio.run(run()) == ["EngineDeadError", "stuck", "EngineDeadError", "stuck"]
    finally:
        release.set()
        engine.shutdown()


def test_a_sink_takes_each_steps_outputs_on_the_engines_thread_and_deliver_the_errors(engine, llama_dir: str):
    """Requests submitted with a sink: each step's outputs of them reach it in one call, on the
    engine's thread, adding up to the greedy tokens; a refusal still reaches `deliver` on the
    loop. A sink that raises fails its requests (aborted, their blocks freed) and nothing else."""
    prompts = mixed_prompts(seed=47, lengths=(9, 5))
    expected = hf_greedy(llama_dir, prompts, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind="delta")

    async def run() -> list:
        loop = asyncio.get_running_loop()
        calls: list[tuple[int, list[str]]] = []
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        done = asyncio.Event()

        def sink(items) -> None:
            calls.append((threading.get_ident(), [out.request_id for _, out in items]))
            for _, out in items:
                tokens[out.request_id].extend(out.outputs[0].token_ids)
                if out.finished and out.request_id == "b":
                    loop.call_soon_threadsafe(done.set)

        errors: dict[str, asyncio.Future] = {r: loop.create_future() for r in ("a", "b", "bad", "boom")}
        for request_id, prompt in zip("ab", prompts):
            engine.submit({"prompt_token_ids": prompt}, params, request_id, errors[request_id].set_result, sink)
        engine.submit({"prompt_token_ids": []}, params, "bad", errors["bad"].set_result, sink)
        refused = await asyncio.wait_for(errors["bad"], 30)
        await asyncio.wait_for(done.wait(), 60)

        def broken(items) -> None:
            raise OSError("the wire broke")

        engine.submit({"prompt_token_ids": prompts[0]}, params, "boom", errors["boom"].set_result, broken)
        failed = await asyncio.wait_for(errors["boom"], 30)
        after = [out async for out in engine.generate({"prompt_token_ids": prompts[1]}, params, "after")]
        return [calls, tokens, type(refused).__name__, failed, after, errors["a"].done() or errors["b"].done()]

    calls, tokens, refused, failed, after, a_or_b_erred = asyncio.run(run())
    assert {thread for thread, _ in calls} == {engine._thread.ident}
    assert sorted(set(r for _, ids in calls for r in ids)) == ["a", "b"]
    assert any(len(ids) == 2 for _, ids in calls)  # the two requests' outputs of a step: one call
    assert [tokens["a"], tokens["b"]] == expected
    assert refused == "ValueError" and not a_or_b_erred
    assert isinstance(failed, RuntimeError) and "the wire broke" in str(failed)
    assert sum((d.outputs[0].token_ids for d in after), []) == expected[1]
    assert wait_for(lambda: engine.engine.pool.num_free_blocks == engine.engine.pool.num_blocks, 10)
    engine.engine.pool.check_all_free()
