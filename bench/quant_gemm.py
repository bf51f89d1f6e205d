"""`tandem bench quantization --gemm-sweep`: one decoder layer's linear products per row count,
by kernel, on Llama-3-8B's shapes (q|k|v 4096 -> 6144, o 4096 -> 4096, gate|up 4096 -> 28672,
down 14336 -> 4096): what decides, per batch size, whether an FP8 layer runs W8A8
(`torch._scaled_mm`, activations rounded to FP8 per token) or the weight-only Triton kernel
that converts weights in registers (workers/kernels/triton_w8.py).

Kernels (CUDA): the model dtype's GEMM (`dense`), `_scaled_mm` with the activations' per-token
quantization (`fp8_w8a8`), and the Triton kernel on FP8 and int8 weights (`fp8_triton`,
`int8_triton`, up to its row limit). On the CPU: float32 `F.linear` (`dense`) and the C++
8-bit kernel on int8 and FP8 weights (`int8_cpu`, `fp8_cpu`). Each figure is the median of
several timed calls, in microseconds per layer (all four products).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.bench.report import Figures
from tandem.workers.device_peaks import sync
from tandem.workers.quant.linear import quantize_weight

LAYER_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # (out, in)
ROWS = (1, 2, 4, 8, 16, 32, 64)
CPU_LAYER_SHAPES = ((1536, 1024), (1024, 1024), (7168, 1024), (1024, 3584))  # a quarter of each side


def _time_us(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def gemm_sweep(device: torch.device, dtype: torch.dtype) -> Figures:
    """`gemm_us_{kernel}_b{rows}` for every kernel and row count (module docstring)."""
    shapes = LAYER_SHAPES if device.type == "cuda" else CPU_LAYER_SHAPES
    gen = torch.Generator(device="cpu").manual_seed(0)
    dense = [(torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=dtype) for n, k in shapes]
    fp8 = [quantize_weight(w, "fp8") for w in dense]
    int8 = [quantize_weight(w, "int8") for w in dense]
    kernels: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"dense": lambda x, i: F.linear(x, dense[i])}
    if device.type == "cuda":
        from tandem.workers.kernels.triton_w8 import MAX_ROWS, w8_matmul

        def w8a8(x: torch.Tensor, i: int) -> torch.Tensor:
            amax = x.abs().amax(dim=-1, keepdim=True).float()
            scale = (amax / 448.0).clamp(min=1e-12)
            q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            w, w_scale = fp8[i]
            return torch._scaled_mm(q, w.t(), scale_a=scale, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)

        kernels["fp8_w8a8"] = w8a8
        kernels["fp8_triton"] = lambda x, i: w8_matmul(x, *fp8[i])
        kernels["int8_triton"] = lambda x, i: w8_matmul(x, *int8[i])
        row_limit = {"fp8_triton": MAX_ROWS, "int8_triton": MAX_ROWS}
    else:
        from tandem.workers.kernels.w8_gemm import w8_linear

        kernels["int8_cpu"] = lambda x, i: w8_linear(x, *int8[i])
        kernels["fp8_cpu"] = lambda x, i: w8_linear(x, *fp8[i])
        row_limit = {}
    fig: Figures = {}
    for rows in ROWS:
        xs = [torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype) for _, k in shapes]
        for name, kernel in kernels.items():
            if rows > row_limit.get(name, rows):
                continue
            fig[f"gemm_us_{name}_b{rows}"] = _time_us(
                lambda kernel=kernel, xs=xs: [kernel(x, i) for i, x in enumerate(xs)], device)
    return fig
