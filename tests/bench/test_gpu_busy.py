"""The GPU busy fraction's arithmetic: the union of kernel intervals over the wall time."""

from __future__ import annotations

from tandem.bench.gpu_busy import (
    busy_fraction,
    gap_calls,
    idle_figures,
    kernel_table,
    merged,
    runtime_call_table,
    union_length,
)


def test_union_counts_overlaps_once_and_gaps_not_at_all() -> None:
    # [0, 3] from two overlapping kernels (two streams), [5, 6] holding a nested one, an empty one.
    kernels = [(5, 6), (0, 2), (1, 3), (5.5, 5.75), (10, 10)]
    assert union_length(kernels) == 4.0
    assert union_length([(2, 4), (0, 1), (1, 2)]) == 4.0  # touching intervals: no double count
    assert union_length([]) == 0.0
    assert busy_fraction(kernels, wall=8.0) == 0.5
    assert busy_fraction([], wall=0.0) == 0.0


def test_idle_figures_place_the_gaps_by_size_and_position() -> None:
    us = 1_000  # ns
    # Kernels (ns): two overlapping, then gaps of 10 us, 50 us, 500 us and 3 ms.
    kernels = [(0, 100 * us), (50 * us, 200 * us), (210 * us, 300 * us), (350 * us, 400 * us),
               (900 * us, 1000 * us), (4000 * us, 5000 * us)]
    fig = idle_figures(kernels, wall_ns=6000 * us, top=2)
    assert fig["gpu_idle_edges_ms"] == 1.0  # a 5 ms span in 6 ms of wall time
    assert (fig["gpu_gaps_under_20us_count"], fig["gpu_gaps_under_20us_ms"]) == (1, 0.01)
    assert (fig["gpu_gaps_20_200us_count"], fig["gpu_gaps_20_200us_ms"]) == (1, 0.05)
    assert (fig["gpu_gaps_200us_2ms_count"], fig["gpu_gaps_200us_2ms_ms"]) == (1, 0.5)
    assert (fig["gpu_gaps_over_2ms_count"], fig["gpu_gaps_over_2ms_ms"]) == (1, 3.0)
    assert fig["gpu_largest_gaps"] == [[3.0, 0.2], [0.5, 0.08]]  # starting 1 ms and 0.4 ms into the span
    assert merged([(3, 4), (0, 2), (1, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]


def test_idle_figures_of_a_run_without_kernels() -> None:
    fig = idle_figures([], wall_ns=2_000_000)
    assert fig["gpu_idle_edges_ms"] == 2.0
    assert fig["gpu_largest_gaps"] == []
    assert fig["gpu_gaps_over_2ms_count"] == 0


def test_replay_summary_is_per_pass_with_the_mean_gap_of_every_size() -> None:
    from tandem.bench.latency import replay_summary

    # Three passes of two kernels each: 100 us busy in 1 ms wall; five gaps, 10 + 30 + 300 us.
    kernels_ns = [(0, 10_000), (20_000, 40_000), (70_000, 80_000), (90_000, 110_000), (410_000, 430_000),
                  (440_000, 460_000)]
    table = [["gemv", 1.0, 10.0, 0.5]]
    gpu = {"gpu_busy": 0.1, "gpu_kernels": len(kernels_ns), **idle_figures(kernels_ns, 1_000_000),
           "gpu_kernel_table": table, "gpu_profiled_wall_ms": 1.0}
    # The same passes took 0.8 ms unprofiled: the profiler made them 1.25x longer.
    assert replay_summary(gpu, 3, 4, unprofiled_ms=0.8) == {
        "replay_b4_gpu_busy": 0.1, "replay_b4_kernels_per_pass": 2.0,
        "replay_b4_mean_gap_us": (10 + 30 + 10 + 300 + 10) / 5, "replay_b4_kernel_table": table,
        "replay_b4_profiler_slowdown": 1.25, "replay_b4_gpu_busy_unprofiled": 0.125}
    assert replay_summary(gpu, 3, 4)["replay_b4_profiler_slowdown"] is None  # no unprofiled timing
    assert replay_summary(None, 0, 1) == dict.fromkeys(
        ["replay_b1_gpu_busy", "replay_b1_kernels_per_pass", "replay_b1_mean_gap_us", "replay_b1_kernel_table",
         "replay_b1_profiler_slowdown", "replay_b1_gpu_busy_unprofiled"])


def test_kernel_table_ranks_kernels_by_total_time_with_launches_per_pass() -> None:
    # Two passes: each a 30 us GEMV, two 5 us norms and one 4 us kernel with a long templated name.
    long_name = "void cutlass::Kernel<" + "x" * 200 + ">"
    kernels = []
    for p in range(2):
        t = p * 1_000_000
        kernels += [("gemv", t, t + 30_000), ("rms_norm", t + 31_000, t + 36_000),
                    ("rms_norm", t + 37_000, t + 42_000), (long_name, t + 43_000, t + 47_000)]
    table = kernel_table(kernels, num_passes=2)
    assert table == [["gemv", 1.0, 30.0, 60 / 88], ["rms_norm", 2.0, 5.0, 20 / 88],
                     [long_name[:90], 1.0, 4.0, 8 / 88]]
    assert kernel_table(kernels, num_passes=2, top=1) == table[:1]
    assert kernel_table([]) == []


def test_runtime_call_table_ranks_the_hosts_cuda_calls_by_the_time_they_took() -> None:
    us = 1_000  # ns
    calls = [("cudaLaunchKernel", 0, 4 * us), ("cudaLaunchKernel", 10 * us, 13 * us),
             ("cudaEventSynchronize", 20 * us, 420 * us), ("cudaStreamSynchronize", 500 * us, 2500 * us),
             ("cudaGraphLaunch", 3000 * us, 3010 * us), ("cudaGraphLaunch", 4000 * us, 4010 * us)]
    assert runtime_call_table(calls) == [["cudaStreamSynchronize", 1, 2.0, 2000.0],
                                         ["cudaEventSynchronize", 1, 0.4, 400.0],
                                         ["cudaGraphLaunch", 2, 0.02, 10.0],
                                         ["cudaLaunchKernel", 2, 0.007, 4.0]]
    assert runtime_call_table(calls, top=1) == [["cudaStreamSynchronize", 1, 2.0, 2000.0]]
    assert runtime_call_table([]) == []


def test_the_largest_gaps_say_what_the_hosts_cuda_calls_were_doing() -> None:
    us = 1_000  # ns
    # Kernels with a 2 ms gap (a 1.9 ms cudaStreamSynchronize in it, then the launch that ends
    # it) and a 500 us gap in which the host made no call until the graph launch 450 us in.
    kernels = [(0, 100 * us), (2100 * us, 2200 * us), (2700 * us, 2800 * us)]
    calls = [("cudaLaunchKernel", 0, 5 * us), ("cudaStreamSynchronize", 150 * us, 2050 * us),
             ("cudaLaunchKernel", 2060 * us, 2065 * us), ("cudaGraphLaunch", 2650 * us, 2660 * us),
             ("cudaEventSynchronize", 2900 * us, 3000 * us)]
    assert gap_calls(kernels, calls) == [[2.0, ["cudaStreamSynchronize", 1900.0], ["cudaLaunchKernel", 1960.0]],
                                         [0.5, ["cudaGraphLaunch", 10.0], ["cudaGraphLaunch", 450.0]]]
    assert gap_calls(kernels, [], top=1) == [[2.0, None, None]]
    assert gap_calls([], calls) == []
