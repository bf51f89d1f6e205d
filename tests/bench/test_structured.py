"""`tandem bench structured`: both runs decode the same tokens; every figure it names is there."""

from __future__ import annotations

from tandem.bench.structured import SCHEMA
from tandem.bench.tandem_runs import run_tandem
from tandem.bench.workload import fixed_length_requests
from tandem.workers.llm import LLM
from tandem.workers.structured.spec import StructuredSpec
from tests.bench.conftest import bench


def test_the_schema_never_completes_so_both_runs_decode_exact_lengths(llama_dir) -> None:
    llm = LLM(llama_dir)
    requests = fixed_length_requests(3, 8, 20, 512, seed=3)
    run = run_tandem(llm, requests, show_progress=False, structured=StructuredSpec.json_schema(SCHEMA))
    assert run.decode_tokens == 19  # every request ran to its 20 tokens: the first, then 19 decodes
    assert len(llm.engine.grammars) == 0
    llm.shutdown()


def test_the_command_reports_both_ratios(llama_dir, tmp_path) -> None:
    figures = bench(tmp_path, "structured", "--model", llama_dir, "--quick", "--repeats", "1", "--idle-wait", "0")
    assert figures["benchmark"] == "structured" and figures["structured_batch"] == 8
    for name in ("b1", "b8"):
        assert figures[f"structured_tpot_ratio_{name}"] > 0
        assert len(figures[f"structured_tpot_ratio_{name}_repeats"]) == 1
    assert figures["compile_ms"] > 0
