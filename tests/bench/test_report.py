"""How benchmarks report: tables marking targets, flat JSON and plots, the busy-machine warning."""

from __future__ import annotations

import json

from tandem.bench import report


def test_table_marks_targets(capsys) -> None:
    report.print_table("t", [("mbu", 0.7, ""), ("engine_overhead", 1.3, "x"), ("other", 5, "")])
    out = capsys.readouterr().out
    assert ">= 0.6  PASS" in out and "<= 1.15  FAIL" in out
    assert report.meets_target("tpot_ratio_vs_hf", 1.0) is True
    assert report.meets_target("unknown", 1.0) is None


def test_write_outputs_and_busy_warning(tmp_path, capsys) -> None:
    figures = {"mfu": 0.5, "device": "cpu", "cpu_count": 2, "load_average_1m": 0.5, "load_average_1m_end": 3.5}
    report.write_outputs(figures, str(tmp_path / "f.json"), str(tmp_path / "f.png"), None)
    assert json.loads((tmp_path / "f.json").read_text()) == figures
    assert not (tmp_path / "f.png").exists()
    err = capsys.readouterr().err
    assert f"wrote {tmp_path / 'f.json'}" in err and "no plot for this benchmark" in err
    report.warn_if_busy(figures)
    assert "load average 3.5 on 2 cores: other processes" in capsys.readouterr().err
    report.warn_if_busy({**figures, "load_average_1m_end": 1.0, "process_cpu_share": 0.5})
    assert "this process got 50% of its threads' CPU time" in capsys.readouterr().err
    report.warn_if_busy({**figures, "device": "cuda"})
    report.warn_if_busy({**figures, "load_average_1m_end": 1.0})
    assert capsys.readouterr().err == ""
