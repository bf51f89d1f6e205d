"""`python -m tandem.bench.step_breakdown` times every phase of a decode step (on CPU here)."""

from __future__ import annotations

import re
import sys

from tandem.bench import step_breakdown


def test_prints_each_phase_per_batch(llama_dir: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["step_breakdown", llama_dir, "--device", "cpu", "--batches", "1,3"])
    step_breakdown.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch")]
    assert [line.split(":")[0] for line in lines] == ["batch 1", "batch 3"]
    for line in lines:
        assert re.search(r"wait [\d.]+, collect after the wait -?[\d.]+, launch [\d.]+, emit [\d.]+$", line), line
