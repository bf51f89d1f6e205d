"""The engine's host work on a timeline, and the GPU's gaps set against it."""

from __future__ import annotations

from tandem.bench.gpu_busy import allocator_figures, clock_offset, host_figures
from tandem.bench.host_timeline import PARTS, HostTimeline, Interval, attribute_gaps, flat_segments
from tandem.workers import LLM, SamplingParams
from tandem.workers.core.scheduler_output import PendingOutput
from tandem.workers.engine.group_engine import GroupEngine
from tests.conftest import tiny_model

US = 1_000  # ns

# One step (0-100 us): launch 0-30 (what: "A"), collect 40-80 holding a wait 50-70, emit 85-95;
# then the caller's loop until the next step (120-150) launches at 120-140 ("B").
STEPS = [Interval(0, 100 * US, "step"), Interval(0, 30 * US, "launch", "A"), Interval(40 * US, 80 * US, "update"),
         Interval(50 * US, 70 * US, "wait"), Interval(85 * US, 95 * US, "emit"),
         Interval(120 * US, 150 * US, "step"), Interval(120 * US, 140 * US, "launch", "B")]


def test_nested_parts_flatten_to_the_innermost_label() -> None:
    segments = [(s.start // US, s.end // US, s.label, s.what) for s in flat_segments(STEPS)]
    assert segments == [(0, 30, "launch", "A"), (30, 40, "step", ""), (40, 50, "update", ""), (50, 70, "wait", ""),
                        (70, 80, "update", ""), (80, 85, "step", ""), (85, 95, "emit", ""), (95, 100, "step", ""),
                        (120, 140, "launch", "B"), (140, 150, "step", "")]


def test_gaps_split_over_the_parts_they_overlap_in_the_gpus_clock() -> None:
    offset = 1_000_000 * US  # the GPU's clock reads 1 s more than perf_counter
    gaps = [(offset + 10 * US, offset + 45 * US), (offset + 90 * US, offset + 130 * US)]
    totals, dominant = attribute_gaps(gaps, flat_segments(STEPS), offset)
    # Gap 1: launch 20 us, step 10, update 5. Gap 2: emit 5, step 5, the loop 20, launch 10.
    assert {p: round(ms * 1e3) for p, ms in totals.items()} == {
        "launch": 30, "wait": 0, "update": 5, "emit": 5, "step": 15, "outside": 20}
    assert dominant == [("launch", "A"), ("outside", "")]


def test_host_figures_keep_gaps_of_20us_or_more_and_name_the_largest() -> None:
    kernels = [(0, 5 * US), (15 * US, 20 * US), (60 * US, 85 * US), (125 * US, 200 * US)]  # gaps 10, 40, 40 us
    fig = host_figures(kernels, STEPS, offset_ns=0.0, top=2)
    # 20-60 us: launch, step, update and wait 10 each (the first of equals names it);
    # 85-125 us: emit 10, step 5, the loop 20, launch 5.
    assert {p: round(fig[f"gpu_gap_ms_under_{p}"] * 1e3) for p in PARTS} == {
        "launch": 15, "wait": 10, "update": 10, "emit": 10, "step": 15, "outside": 20}
    assert fig["gpu_largest_gaps_host"] == [[0.04, "launch", "A"], [0.04, "outside", ""]]
    assert set(host_figures(kernels, STEPS, offset_ns=None).values()) == {None}


def test_the_clocks_offset_from_two_synchronisations() -> None:
    marks = [(1_000, 1_050), (9_000, 9_040)]
    assert clock_offset(marks, [5_001_000, 5_004_000, 5_009_020]) == 5_000_010.0
    assert clock_offset(marks, [5_001_000, 5_300_000]) is None  # the estimates disagree by 291 us
    assert clock_offset(marks, [5_001_000]) is None


def test_allocator_counters_as_the_runs_growth() -> None:
    before = {"num_alloc_retries": 1, "num_device_alloc": 10, "num_device_free": 2}
    after = {"num_alloc_retries": 3, "num_device_alloc": 14, "num_device_free": 2}
    assert allocator_figures(before, after) == {"gpu_alloc_retries": 2, "gpu_device_mallocs": 4,
                                                "gpu_device_frees": 0}
    assert allocator_figures({}, {})["gpu_alloc_retries"] is None


def test_an_engine_run_is_recorded_part_by_part_and_unwrapped_after() -> None:
    llm = LLM(tiny_model("llama"), device="cpu", max_num_seqs=4)
    engine = llm.engine
    result = PendingOutput.result
    with HostTimeline(engine) as timeline:
        llm.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [14, 15]}],
                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert PendingOutput.result is result
    assert "step" not in vars(engine) and engine._launch.__func__ is GroupEngine._launch
    labels = [i.label for i in timeline.intervals]
    # Without overlap (CPU) each step() collects (nothing in flight), launches, emits (nothing),
    # then collects its own step (one wait) and emits it: 3 steps for 3 tokens.
    assert [labels.count(part) for part in ("step", "launch", "update", "wait", "emit")] == [3, 3, 6, 3, 6]
    launches = [i.what for i in timeline.intervals if i.label == "launch"]
    assert launches == ["2 requests, 5 tokens, 2 prompt chunks", "2 requests, 2 tokens, 0 prompt chunks",
                        "2 requests, 2 tokens, 0 prompt chunks"]
    steps = [i for i in timeline.intervals if i.label == "step"]
    for inner in timeline.intervals:
        assert any(s.start <= inner.start <= inner.end <= s.end for s in steps)
    llm.shutdown()


def test_the_profilers_clock_lines_up_with_the_timeline(monkeypatch) -> None:
    """On CPU the profiler's CPU ops stand in for kernels: the gaps between them are host work
    in the engine's parts, so almost none may fall outside them once the clocks are lined up
    (kineto's events carry Unix-epoch times; perf_counter's are since boot)."""
    import torch
    import torch.autograd
    import torch.profiler

    from tandem.bench import gpu_busy
    from tandem.bench.tandem_runs import run_tandem
    from tandem.bench.workload import WorkloadSpec, make_workload

    class CpuAsCuda:
        CUDA = CPU = torch.profiler.ProfilerActivity.CPU

    class CpuAsCudaDevice:
        CUDA = CPU = torch.autograd.DeviceType.CPU

    monkeypatch.setattr(torch.profiler, "ProfilerActivity", CpuAsCuda)
    monkeypatch.setattr(torch.autograd, "DeviceType", CpuAsCudaDevice)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    llm = LLM(tiny_model("llama"), device="cpu", max_num_seqs=4)
    requests = make_workload(WorkloadSpec(num_requests=3, prompt_len=(4, 9), output_len=(20, 30)), 512)
    def profiled() -> dict:
        return gpu_busy.profiled_gpu_figures(lambda: run_tandem(llm, requests, show_progress=False),
                                             torch.device("cpu"), engine=llm.engine)

    fig = profiled()
    assert fig["gpu_host_clock"] == "epoch"  # no cudaDeviceSynchronize on CPU
    under = {part: fig[f"gpu_gap_ms_under_{part}"] for part in PARTS}
    assert under["launch"] > 0 and under["outside"] < 0.2 * sum(under.values()), under
    assert fig["gpu_alloc_retries"] is None
    # The host-side events (here the CPU ops themselves), by the time they took.
    calls = fig["gpu_runtime_calls"]
    assert 0 < len(calls) <= 12 and all(count >= 1 and longest * 1e-3 <= total for _, count, total, longest in calls)
    assert [row[2] for row in calls] == sorted((row[2] for row in calls), reverse=True)
    gaps = fig["gpu_largest_gaps_calls"]
    assert 0 < len(gaps) <= 5 and [g[0] for g in gaps] == sorted((g[0] for g in gaps), reverse=True)

    def broken(*args: object) -> dict:
        raise RuntimeError("no timeline")

    # A diagnostic that fails says so, and the pass keeps its other figures.
    monkeypatch.setattr(gpu_busy, "host_figures", broken)
    fig = profiled()
    llm.shutdown()
    assert fig["gpu_host_clock"] == "failed: RuntimeError: no timeline"
    assert fig["gpu_gap_ms_under_launch"] is None and fig["gpu_largest_gaps_host"] is None
    assert fig["gpu_busy"] > 0 and fig["gpu_kernels"] > 0
