"""The GPU busy fraction's arithmetic: the union of kernel intervals over the wall time."""

from __future__ import annotations

from tandem.bench.gpu_busy import busy_fraction, union_length


def test_union_counts_overlaps_once_and_gaps_not_at_all() -> None:
    # [0, 3] from two overlapping kernels (two streams), [5, 6] holding a nested one, an empty one.
    kernels = [(5, 6), (0, 2), (1, 3), (5.5, 5.75), (10, 10)]
    assert union_length(kernels) == 4.0
    assert union_length([(2, 4), (0, 1), (1, 2)]) == 4.0  # touching intervals: no double count
    assert union_length([]) == 0.0
    assert busy_fraction(kernels, wall=8.0) == 0.5
    assert busy_fraction([], wall=0.0) == 0.0
