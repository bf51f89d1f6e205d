"""The systems a benchmark compares, and the options that pick their model."""

from __future__ import annotations

import pytest

from tandem.bench.systems import BenchOptions


def test_bench_options_take_one_model() -> None:
    with pytest.raises(ValueError, match="--model and --bench-model"):
        BenchOptions(model="m", bench_model="llama-1b")
    with pytest.raises(ValueError, match="bench_model: must be one of llama-1b, llama-8b"):
        BenchOptions(bench_model="llama-70b")
    assert BenchOptions(bench_model="llama-8b").bench_model == "llama-8b"  # built when a benchmark runs, not here
