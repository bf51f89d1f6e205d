from __future__ import annotations

from tandem.bench.spec import _copy_heavy_prompts, run_spec_bench
from tests.conftest import tiny_model


def test_copy_heavy_prompts_repeat_a_passage() -> None:
    prompts = _copy_heavy_prompts(2, 5, 100, seed=0)
    assert all(p[:5] * 3 == p for p in prompts) and prompts[0] != prompts[1]


def test_spec_bench_reports_the_named_figures() -> None:
    figures = run_spec_bench(tiny_model("llama"), quick=True, k=2, repeats=1, progress=False)
    for key in ("tpot_speedup", "saturation_throughput_ratio", "acceptance_rate", "tpot_plain_ms", "tpot_spec_ms"):
        assert isinstance(figures[key], float) and figures[key] >= 0.0
    assert not any(isinstance(v, dict) for v in figures.values())
