"""Probes of what this machine can do, measured in the same run as the benchmark they divide.

- `matmul_flops`: a large square matmul in the model's dtype (the MFU denominator).
- `copy_bandwidth`: a large tensor copy, counting bytes read plus bytes written, as STREAM
  does (the MBU denominator).
- `gemv_read_bandwidth`: bytes of a large matrix streamed by one matrix-vector product; on
  CPUs it is well above the copy figure (no write traffic), so MBU against it is reported too.

And a guard for shared machines: `run_uncontended` waits for the CPU to be idle, runs a
measurement while watching how much CPU *other* processes used (Linux /proc/stat), and runs
it again when they took more than a threshold. On a 2-core machine a neighbour's test suite
slows a batch-1 decode loop tenfold (OpenMP threads wait on descheduled peers), so a figure
measured beside one means nothing.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul (2 n^3 FLOPs); n = 2048 on CPU, 8192 on GPU."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = time_median(lambda: torch.matmul(a, b, out=out), device, repeats)
    return 2 * n ** 3 / seconds


def copy_bandwidth(device: torch.device, num_bytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of `dst.copy_(src)` counting read + write; 256 MiB on CPU, 2 GiB on GPU."""
    num_bytes = num_bytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.ones(num_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = time_median(lambda: dst.copy_(src), device, repeats)
    return 2 * num_bytes / seconds


def gemv_read_bandwidth(device: torch.device, dtype: torch.dtype, num_bytes: int | None = None,
                        repeats: int = 5) -> float:
    """Bytes/s of the matrix read by `matrix @ vector` (64 MiB on CPU, 1 GiB on GPU)."""
    num_bytes = num_bytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    cols = 2048
    rows = num_bytes // (cols * dtype.itemsize)
    matrix = torch.ones(rows, cols, device=device, dtype=dtype)
    vector = torch.ones(cols, device=device, dtype=dtype)
    seconds = time_median(lambda: torch.mv(matrix, vector), device, repeats)
    return rows * cols * dtype.itemsize / seconds


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
