"""Probes of what a device can do: the denominators of MFU and MBU.

`tandem bench` measures them in the same run as the figures they divide; a serving group
probes them once at start-up for its live MBU / MFU gauges (workers/serving/group_metrics.py).

- `matmul_flops`: a large square matmul in the model's dtype (the MFU denominator).
- `copy_bandwidth`: a large tensor copy, counting bytes read plus bytes written, as STREAM
  does (the MBU denominator).
- `gemv_read_bandwidth`: bytes of a large matrix streamed by one matrix-vector product; on
  CPUs it is well above the copy figure (no write traffic), so MBU against it is reported too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DevicePeaks:
    """What one device can do: the MFU and MBU denominators."""

    flops_per_s: float  # matmul_flops in the model's dtype
    bytes_per_s: float  # copy_bandwidth (read + write), as `tandem bench latency` divides by

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype, quick: bool = False) -> DevicePeaks:
        """`quick`: the server's start-up probe on a CPU, a quarter of the bench's sizes (a
        1024^3 matmul, a 64 MiB copy; ~0.5 s on one core instead of seconds). On a GPU the
        bench's sizes take milliseconds, and are kept."""
        small = quick and device.type == "cpu"
        return DevicePeaks(flops_per_s=matmul_flops(device, dtype, n=1024 if small else None, repeats=3),
                           bytes_per_s=copy_bandwidth(device, num_bytes=(64 << 20) if small else None, repeats=3))
