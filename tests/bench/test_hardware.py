"""Machine figures: the contention check, once, when told not to wait."""

from __future__ import annotations

import torch


def test_contention_log_runs_once_when_told_not_to_wait() -> None:
    from tandem.bench.hardware import ContentionLog, CpuMonitor
    calls = []
    log = ContentionLog(max_wait_s=0, max_attempts=1)
    assert log.run(lambda: calls.append(1) or 7, torch.device("cpu")) == 7
    assert calls == [1] and log.figures()["contention_runs"] == 1
    assert log.figures()["contention_runs_redone"] == 0
    with CpuMonitor() as monitor:
        sum(range(10 ** 5))
    assert monitor.foreign_fraction is None or monitor.foreign_fraction >= 0.0
