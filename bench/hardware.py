"""What a benchmark's figures were measured on, and a guard against CPU contention.

The probes of what the device can do (matmul FLOP/s, copy and GEMV bandwidth) are
`workers/device_peaks.py`, shared with the server's live MBU / MFU gauges.

A guard for shared machines: `run_uncontended` waits for the CPU to be idle, runs a
measurement while watching how much CPU *other* processes used (Linux /proc/stat), and runs
it again when they took more than a threshold. On a 2-core machine a neighbour's test suite
slows a batch-1 decode loop tenfold (OpenMP threads wait on descheduled peers), so a figure
measured beside one means nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch


def machine_figures(device: torch.device) -> dict[str, object]:
    """What the figures were measured on, including how busy the machine was."""
    import platform

    import transformers

    figures: dict[str, object] = {
        "cpu_count": os.cpu_count(), "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "platform": platform.platform(), "load_average_1m": os.getloadavg()[0],
    }
    if device.type == "cuda":
        figures["gpu_name"] = torch.cuda.get_device_name(device)
    return figures


# ---- contention ----------------------------------------------------------------------------------
T = TypeVar("T")
CONTENTION_THRESHOLD = 0.10  # other processes' share of all cores above which a run is redone


def _cpu_busy_seconds() -> float | None:
    """Seconds all cores have spent busy since boot (None where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuMonitor:
    """`foreign_fraction`: CPU time other processes used during the block / (wall x cores)."""

    def __enter__(self) -> CpuMonitor:
        self.foreign_fraction: float | None = None
        self._busy, self._own, self._wall = _cpu_busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _cpu_busy_seconds()
        if busy is None or self._busy is None:
            return
        wall = time.perf_counter() - self._wall
        foreign = (busy - self._busy) - (time.process_time() - self._own)
        self.foreign_fraction = max(0.0, foreign) / (wall * (os.cpu_count() or 1))


def wait_for_idle(max_wait_s: float, threshold: float = CONTENTION_THRESHOLD, window_s: float = 0.5) -> float:
    """Block until other processes use < threshold of the CPU over one window; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        with CpuMonitor() as monitor:
            time.sleep(window_s)
        if monitor.foreign_fraction is None or monitor.foreign_fraction < threshold:
            break
    return time.perf_counter() - start


@dataclass
class ContentionLog:
    """How contended a benchmark's CPU runs were: reported, so readers can judge the figures."""

    # How long to wait for quiet, and how often to redo a disturbed run.
    max_wait_s: float = 60.0
    max_attempts: int = 3
    # What happened, for the report.
    num_runs: int = 0
    num_redone: int = 0
    worst_foreign_fraction: float = 0.0  # over the runs that were kept
    waited_s: float = 0.0
    _last_disturbed: bool = False

    def run(self, fn: Callable[[], T], device: torch.device) -> T:
        """fn(), redone (up to max_attempts) when others used more than the threshold of the CPU.

        Before a redo, and before any run that follows a disturbed one, it waits for the CPU to
        go quiet; on a quiet machine it never waits.
        """
        if device.type != "cpu":
            return fn()
        for attempt in range(self.max_attempts):
            if attempt > 0 or self._last_disturbed:
                self.waited_s += wait_for_idle(self.max_wait_s)
            with CpuMonitor() as monitor:
                result = fn()
            foreign = monitor.foreign_fraction or 0.0
            self._last_disturbed = foreign > CONTENTION_THRESHOLD
            if not self._last_disturbed or attempt == self.max_attempts - 1:
                break
            self.num_redone += 1
        self.num_runs += 1
        self.worst_foreign_fraction = max(self.worst_foreign_fraction, foreign)
        return result

    def figures(self) -> dict[str, float]:
        return {"contention_runs": self.num_runs, "contention_runs_redone": self.num_redone,
                "contention_worst_foreign_cpu": self.worst_foreign_fraction,
                "contention_waited_s": self.waited_s}
