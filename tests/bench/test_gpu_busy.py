"""The GPU busy fraction's arithmetic: the union of kernel intervals over the wall time."""

from __future__ import annotations

from tandem.bench.gpu_busy import busy_fraction, idle_figures, merged, union_length


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
