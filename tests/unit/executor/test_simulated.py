"""SimulatedExecutor: the wait a step takes, its deterministic tokens, and the engine around it."""

from __future__ import annotations

import pytest

from tandem.workers.config import EngineConfig
from tandem.workers.core.output_pace import OutputPace
from tandem.workers.core.request import PENDING_TOKEN, Logprob, SamplingParams
from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.workers.executor.simulated import SimulatedExecutor, prompt_key, splitmix64
from tandem.workers.model.hf_config import HFModelConfig

# A config.json's worth of a small Llama: no files, no weights.
HF = HFModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16"})
GREEDY = SamplingParams(temperature=0.0)


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def executor(step_ms: str = "2,0.5", clock: FakeClock | None = None, **options) -> SimulatedExecutor:
    clock = clock or FakeClock(0.0)
    config = EngineConfig.from_options(simulated_step_ms=step_ms, **options)
    return SimulatedExecutor(config, HF, special_token_ids=(0, 3), clock=clock, sleep=clock.sleep)


def new(req_id: str, prompt: list[int], computed: int = 0, params: SamplingParams = GREEDY) -> NewRequestData:
    return NewRequestData(req_id, prompt, [], params, [0], computed)


def prefill_step(prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> SchedulerOutput:
    return SchedulerOutput(0, new_requests=[new(r, p, params=params) for r, p in prompts.items()],
                           num_scheduled_tokens={r: len(p) for r, p in prompts.items()})


def decode_step(tokens: dict[str, tuple[int, int]]) -> SchedulerOutput:
    """req_id -> (its new token, its computed tokens before the step)."""
    return SchedulerOutput(1, cached_requests=[CachedRequestData(r, [t], [], c, 1) for r, (t, c) in tokens.items()],
                           num_scheduled_tokens={r: 1 for r in tokens})


# ---- the wait -----------------------------------------------------------------------------------
def test_a_step_waits_base_plus_per_seq_for_each_request() -> None:
    clock = FakeClock(10.0)
    sim = executor("2,0.5", clock)
    pending = sim.execute_async(prefill_step({"a": [5, 6], "b": [7], "c": [8, 9, 10]}))
    assert clock.sleeps == []  # launching never waits
    clock.now = 10.001
    pending.result()
    # 2 + 0.5 x 3 requests = 3.5 ms from the launch at 10.0
    assert clock.sleeps == [pytest.approx(0.0025, abs=1e-12)]


def test_a_step_launched_ahead_queues_behind_the_one_running() -> None:
    clock = FakeClock(10.0)
    sim = executor("2,0.5", clock)
    first = sim.execute_async(prefill_step({"a": [5, 6]}))  # runs 10.0 .. 10.0025
    clock.now = 10.001
    second = sim.execute_async(decode_step({"a": (-1, 2)}))  # ahead, on a placeholder
    first.result()
    second.result()  # starts when the first ends: 10.0025 .. 10.005
    assert clock.sleeps == [pytest.approx(0.0015, abs=1e-12), pytest.approx(0.004, abs=1e-12)]
    clock.now = 11.0
    third = sim.execute_async(decode_step({"a": (0, 3)}))  # the device is idle: it starts now
    clock.now = 11.0025
    third.result()  # and it is over already: no wait
    assert len(clock.sleeps) == 2


def test_a_multi_step_step_waits_its_passes_and_gives_each_request_its_next_tokens() -> None:
    clock = FakeClock(10.0)
    sim = executor("2,0.5", clock, num_scheduler_steps=4)
    prompts = {"a": [5, 6], "b": [7, 8, 9]}
    first = sim.execute(prefill_step(prompts))
    clock.now = 11.0
    step = decode_step({"a": (first.sampled_token_ids[0][0], 2), "b": (first.sampled_token_ids[1][0], 3)})
    step.num_steps = 3
    pending = sim.execute_async(step)
    out = pending.result()
    # 3 passes of 2 + 0.5 x 2 requests = 9 ms from the launch at 11.0
    assert clock.sleeps[-1] == pytest.approx(0.009, abs=1e-12)
    assert out.sampled_token_ids == [[sim.token(prompt_key(p), i) for i in (1, 2, 3)] for p in prompts.values()]
    assert pending.on_device == frozenset(prompts)  # plain greedy: the next step may go ahead on them


def test_a_step_with_no_tokens_is_done_at_once() -> None:
    clock = FakeClock(1.0)
    sim = executor("2,0.5", clock)
    sim.execute_async(prefill_step({"a": [5, 6]})).result()
    out = sim.execute_async(SchedulerOutput(1, finished_req_ids={"a"})).result()
    assert (out.req_ids, clock.sleeps, sim.requests) == ([], [pytest.approx(0.0025, abs=1e-12)], {})


# ---- tokens ---------------------------------------------------------------------------------------
def test_tokens_are_a_function_of_prompt_and_position() -> None:
    sim = executor()
    key = prompt_key([5, 6, 7])
    assert key == prompt_key([5, 6, 7]) != prompt_key([5, 6, 8])
    assert splitmix64(0) == 0 and splitmix64(1) == 0x5692161D100B05E5  # splitmix64's reference value
    # allowed: 64 ids less BOS 1, EOS 2 and the tokenizer's specials 0 and 3
    assert len(sim.allowed) == 60 and not {0, 1, 2, 3} & set(sim.allowed)
    tokens = [sim.token(key, i) for i in range(200)]
    assert tokens == [sim.token(key, i) for i in range(200)]
    assert not {0, 1, 2, 3} & set(tokens) and max(tokens) < 64
    assert len(set(tokens)) > 40  # not a constant, nor a short cycle


def test_a_chunked_prefill_gives_nothing_then_the_first_token() -> None:
    sim = executor()
    prompt = list(range(10, 20))
    first = SchedulerOutput(0, new_requests=[new("a", prompt)], num_scheduled_tokens={"a": 6})
    assert sim.execute(first).sampled_token_ids == [[]]
    rest = SchedulerOutput(1, cached_requests=[CachedRequestData("a", [], [], 6, 1)], num_scheduled_tokens={"a": 4})
    t0 = sim.token(prompt_key(prompt), 0)
    assert sim.execute(rest).sampled_token_ids == [[t0]]
    # a placeholder (PENDING_TOKEN) counts as the token it stands for: the next position
    ahead = SchedulerOutput(2, cached_requests=[CachedRequestData("a", [-1], [], 10, 1)],
                            num_scheduled_tokens={"a": 1})
    assert sim.execute(ahead).sampled_token_ids == [[sim.token(prompt_key(prompt), 1)]]


def test_a_resumed_request_goes_on_where_it_was() -> None:
    sim = executor()
    prompt = [10, 11, 12]
    t = [sim.token(prompt_key(prompt), i) for i in range(3)]
    resumed = SchedulerOutput(0, new_requests=[NewRequestData("a", prompt, t[:2], GREEDY, [0], 0)],
                              num_scheduled_tokens={"a": 5})
    assert sim.execute(resumed).sampled_token_ids == [[t[2]]]


def test_logprobs_the_token_first_then_runners_up() -> None:
    sim = executor()
    params = SamplingParams(logprobs=3, prompt_logprobs=2)
    out = sim.execute(prefill_step({"a": [10, 11, 12]}, params))
    [[token]] = out.sampled_token_ids
    assert out.logprobs == [[{token: Logprob(0.0, 1), (token + 1) % 64: Logprob(-1.0, 2),
                              (token + 2) % 64: Logprob(-2.0, 3)}]]
    # prompt tokens 1 and 2 are scored (nothing predicts token 0)
    assert out.prompt_logprobs == {"a": (1, [{11: Logprob(0.0, 1), 12: Logprob(-1.0, 2)},
                                             {12: Logprob(0.0, 1), 13: Logprob(-1.0, 2)}])}


def test_tokens_stay_on_the_device_where_a_gpu_runner_leaves_them() -> None:
    sim = executor()
    sampled = SamplingParams(temperature=1.0)
    assert sim.execute_async(prefill_step({"a": [10, 11]})).on_device == frozenset({"a"})  # plain greedy
    assert sim.execute_async(prefill_step({"b": [10, 11]}, sampled)).on_device is None  # sampled prompt
    assert sim.execute_async(decode_step({"b": (5, 2)})).on_device == frozenset({"b"})  # sampled decodes
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.2)
    sim.execute(prefill_step({"c": [10, 11]}, penalised))
    assert sim.execute_async(decode_step({"c": (5, 2)})).on_device is None


def test_kv_blocks_sized_as_the_runner_sizes_them() -> None:
    # bfloat16 (the model's dtype on a GPU): 2 (K, V) x 2 layers x 2 heads x 8 dims x 2 bytes x 16 slots
    assert executor().kv_bytes_per_block() == 2 * 2 * 2 * 8 * 2 * 16
    # Unless told: room for max_num_seqs sequences of the longest length (blocks are bookkeeping).
    assert executor().num_kv_blocks == 128 * (HF.max_position_embeddings // 16)
    assert executor(max_num_seqs=3, max_model_len=40).num_kv_blocks == 3 * 3
    assert executor(kv_cache_memory=10_000).num_kv_blocks == 4
    assert executor(num_kv_blocks=7).num_kv_blocks == 7
    with pytest.raises(ValueError, match="^kv_cache_memory: too small"):
        executor(kv_cache_memory=100)


def test_kv_bytes_per_block_match_a_loaded_runner() -> None:
    from tandem.workers.executor.uniproc import UniProcExecutor
    from tandem.workers.model.demo_model import demo_model_path

    config = EngineConfig.from_options(dtype="float32", device="cpu", num_kv_blocks=2)
    hf = HFModelConfig.from_dir(demo_model_path())
    real = UniProcExecutor(config, hf, demo_model_path(), show_progress=False)
    try:
        sim = SimulatedExecutor(EngineConfig.from_options(dtype="float32", simulated_step_ms=(0, 0)), hf)
        assert sim.kv_bytes_per_block() == real.kv_bytes_per_block()
    finally:
        real.shutdown()


# ---- the engine on it -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from tandem.workers.llm import LLM

    llm = LLM(simulated_step_ms=(0, 0), max_num_seqs=4, max_num_batched_tokens=32)
    yield llm
    llm.shutdown()


PROMPTS = [{"prompt_token_ids": p} for p in ([40, 41, 42], list(range(100, 200)), [7] * 20)]


def test_the_engine_runs_on_the_simulated_device(llm) -> None:
    assert isinstance(llm.engine.executor, SimulatedExecutor)
    assert llm.engine.overlap_steps and llm.engine.model_in_process  # like the GPU engine


def test_max_tokens_exactly_the_same_tokens_whatever_the_sampling(llm) -> None:
    sim = llm.engine.executor
    runs = [llm.generate(PROMPTS, SamplingParams(temperature=t, max_tokens=24), use_tqdm=False)
            for t in (0.0, 0.0, 1.0)]
    special = {*llm.tokenizer.all_special_ids, *llm.engine.hf_config.eos_token_ids}
    for prompt, out in zip(PROMPTS, runs[0]):
        key = prompt_key(prompt["prompt_token_ids"])
        assert out.outputs[0].token_ids == [sim.token(key, i) for i in range(24)]
        assert out.outputs[0].finish_reason == "length" and not special & set(out.outputs[0].token_ids)
    assert [[o.outputs[0].token_ids for o in run] for run in runs[1:]] == [[o.outputs[0].token_ids
                                                                             for o in runs[0]]] * 2


def test_a_long_prompt_is_chunked_then_decoded(llm) -> None:
    seen: list[list[list[int]]] = []  # each step's tokens (the request runs alone)
    ahead: list[bool] = []  # each step's: scheduled ahead of the last one's token (a placeholder)
    sim = llm.engine.executor
    launch = sim.execute_async

    def spy(step: SchedulerOutput):
        ahead.append(any(PENDING_TOKEN in diff.new_token_ids for diff in step.cached_requests))
        pending = launch(step)
        pending.then(lambda out: seen.append(out.sampled_token_ids) if out.req_ids else None)
        return pending

    sim.execute_async = spy
    try:
        # a prompt no other test sent: no prefix of it is cached
        [out] = llm.generate({"prompt_token_ids": list(range(300, 400))},
                             SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    finally:
        del sim.execute_async
    t = out.outputs[0].token_ids
    # 100 prompt tokens in a 32-token budget: 32, 32, 32, then 4 and the first token
    assert seen == [[[]], [[]], [[]], [[t[0]]], [[t[1]]], [[t[2]]]]
    # greedy: each decode is launched before the token it decodes is back, as on a GPU
    assert ahead[:6] == [False, False, False, False, True, True]


def test_every_block_is_free_after_finishing_and_after_an_abort(llm) -> None:
    engine = llm.engine
    llm.generate(PROMPTS, SamplingParams(max_tokens=5), use_tqdm=False)
    engine.pool.check_all_free()
    engine.add_request("x", PROMPTS[1], SamplingParams(max_tokens=50))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    engine.abort_request("x")
    engine.pool.check_all_free()
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # carries the finished ids to the device
    assert engine.executor.requests == {}


def test_logprobs_through_the_engine(llm) -> None:
    params = SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    completion = out.outputs[0]
    assert [len(lp) for lp in completion.logprobs] == [2] * 4
    assert [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)] == [0.0] * 4
    assert completion.cumulative_logprob == 0.0
    assert out.prompt_logprobs[0] is None
    assert [{t: lp.logprob for t, lp in e.items()} for e in out.prompt_logprobs[1:]] == [{41: 0.0}, {42: 0.0}]


def test_preempted_requests_resume_their_tokens() -> None:
    from tandem.workers.llm import LLM

    # 12 blocks of 16 slots; four requests of 40 + 30 tokens want 20: some are preempted
    llm = LLM(simulated_step_ms=(0, 0), num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    try:
        prompts = [[20 + i] * 40 for i in range(4)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=30),
                            use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        sim = llm.engine.executor
        assert [o.outputs[0].token_ids for o in outs] == [[sim.token(prompt_key(p), i) for i in range(30)]
                                                          for p in prompts]
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()


def test_a_grammar_row_gets_a_token_its_grammar_allows(llm) -> None:
    import re

    from tandem.workers.structured.spec import StructuredSpec

    spec = StructuredSpec("regex", "[a-c]{3}-[0-9]{2}")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, structured=spec), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" and re.fullmatch(spec.value, o.outputs[0].text) for o in outs)
    assert len(llm.engine.grammars) == 0


@pytest.mark.parametrize("max_tokens", [1, 9, 13, 24])
def test_multi_step_gives_the_same_tokens_as_one_pass_a_step(max_tokens: int) -> None:
    from tandem.workers.llm import LLM

    llm = LLM(simulated_step_ms=(0, 0), max_num_seqs=4, max_num_batched_tokens=32, num_scheduler_steps=8)
    try:
        passes: list[int] = []
        launch = llm.engine.executor.execute_async

        def spy(step: SchedulerOutput):
            passes.append(step.num_steps)
            return launch(step)

        llm.engine.executor.execute_async = spy
        params = SamplingParams(max_tokens=max_tokens, logprobs=1)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        sim = llm.engine.executor
        for prompt, out in zip(PROMPTS, outs):
            expected = [sim.token(prompt_key(prompt["prompt_token_ids"]), i) for i in range(max_tokens)]
            assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "length"
            assert [next(iter(lp)) for lp in out.outputs[0].logprobs] == expected
        assert (max(passes) == 8) == (max_tokens > 1)  # answered whole: every pass it may run
        llm.engine.pool.check_all_free()
    finally:
        llm.shutdown()


class EngineClock:
    """One fake time for an engine and its simulated device: a step's wait moves it on, the host's
    work takes none, so a pass measures exactly the simulated step."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _passes_of_a_stream(pace: OutputPace | None, monkeypatch, max_tokens: int = 40) -> tuple[list[int], list[int]]:
    """A streamed request alone on a simulated device of 1 ms steps, multi-step 8, on one fake
    clock with the engine (the host's work takes no time): each step's passes, and how many
    tokens each of its outputs carried."""
    from tandem.workers.engine import group_engine
    from tandem.workers.llm import LLM

    llm = LLM(simulated_step_ms=(1, 0), num_scheduler_steps=8)
    try:
        engine, passes, sizes = llm.engine, [], []
        clock = EngineClock()
        monkeypatch.setattr(group_engine, "time", clock)
        engine.executor._clock, engine.executor.wait = clock.monotonic, clock.sleep
        launch = engine.executor.execute_async

        def spy(step: SchedulerOutput):
            passes.append(step.num_steps)
            return launch(step)

        engine.executor.execute_async = spy
        engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=max_tokens, output_kind="delta"), pace)
        while engine.has_unfinished_requests():
            sizes += [len(out.outputs[0].token_ids) for out in engine.step()]
        assert sum(sizes) == max_tokens
        return passes, sizes
    finally:
        llm.shutdown()


def test_a_stream_paced_shorter_than_a_pass_gets_one_pass_a_step_and_each_token_at_once(monkeypatch) -> None:
    # A served stream alone: its channel's pace is half a millisecond, a pass takes one.
    passes, sizes = _passes_of_a_stream(OutputPace(0.0005), monkeypatch)
    assert set(passes) == {1} and sizes == [1] * 40


def test_a_stream_without_a_pace_gets_every_pass(monkeypatch) -> None:
    # Read at every step by the engine's caller: each output says a step's tokens, up to eight.
    passes, sizes = _passes_of_a_stream(None, monkeypatch)
    assert passes[1:] == [8] * 5 and sizes == [1, 8, 8, 8, 8, 7]


def test_a_paced_stream_gets_every_pass_its_pace_allows(monkeypatch) -> None:
    # One output in ten seconds: any pass fits 8 times in it. The first two decode
    # steps (the second scheduled ahead of the first's token) are launched before any decode
    # step's time is measured, so they run one pass each.
    passes, sizes = _passes_of_a_stream(OutputPace(10.0), monkeypatch)
    assert passes[:3] == [1, 1, 1] and set(passes[3:]) == {8}
    assert sizes == [1, 39]  # the first token at once; the rest when the request ends


def test_max_passes_is_the_shortest_pace_over_a_pass() -> None:
    from tandem.workers.llm import LLM

    llm = LLM(simulated_step_ms=(0, 0), num_scheduler_steps=8)
    try:
        engine = llm.engine
        delta, final = SamplingParams(output_kind="delta"), SamplingParams(output_kind="final")
        engine.add_request("whole", PROMPTS[0], final)
        assert engine.max_passes() == 8  # answered whole: nothing waits on a pass
        engine.add_request("paced", PROMPTS[1], delta, OutputPace(0.0095))
        assert engine.max_passes() == 1  # no pass measured yet
        engine.pass_s = 0.002
        assert engine.max_passes() == 4  # 9.5 ms holds four 2 ms passes
        engine.add_request("slower", PROMPTS[2], delta, OutputPace(0.005))
        assert engine.max_passes() == 2
        engine.pass_s = 0.006
        assert engine.max_passes() == 1  # a pass longer than a pace
        engine.abort_request("slower")
        engine.add_request("unpaced", [9, 10, 11], delta)
        engine.pass_s = 0.001
        assert engine.max_passes() == 8  # read at every step by the engine's caller: no pace to keep
        engine.abort_request("paced")
        engine.add_request("alone", [12, 13], delta, OutputPace(0.0005))
        assert engine.max_passes() == 1  # a served stream alone: its pace is shorter than a pass
    finally:
        llm.shutdown()


def test_a_paced_output_comes_at_the_step_end_nearest_its_time(monkeypatch) -> None:
    # A pace of 8.5 ms over passes of exactly 1 ms: steps of 8 passes, each ending 0.5 ms short
    # of the stream's next time. Each step's end is the nearest to it: every step says its 8
    # tokens (the first token alone, then two one-pass steps before a pass is measured, and the
    # first 8-pass step, together).
    passes, sizes = _passes_of_a_stream(OutputPace(0.0085), monkeypatch, max_tokens=43)
    assert passes[1:] == [1, 1, 8, 8, 8, 8, 8] and sizes == [1, 10, 8, 8, 8, 8]
