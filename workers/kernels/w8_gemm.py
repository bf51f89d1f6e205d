"""Linear layers on 8-bit weights on the CPU (csrc/w8_gemm.cpp): int8 or FP8 e4m3 weights with
a float32 scale per output row, converted to float in registers.

A batch-1 decode step reads each weight once, so 8-bit weights cut its time to about a
quarter of float32's where memory bounds it; torch's own `_weight_int8pack_mm` runs slower
than float32 here (figures in bench/RESULTS.md). Without a compiler, or with
TANDEM_CPU_KERNELS=0, the layers dequantize in torch (the same values, more memory traffic).
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.workers.kernels.cpu_kernels import CompiledExtension

_W8_GEMM = CompiledExtension("the 8-bit weight GEMM", "tandem_w8_gemm", ("w8_gemm.cpp",),
                             "8-bit linear layers dequantize in torch",
                             variants=(("", ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"]),
                                       ("_serial", ["-O3", "-march=native", "-fopenmp-simd"], [])))


def w8_gemm() -> Any:
    """The compiled module, or None where it cannot be had here."""
    return _W8_GEMM.get()


def w8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ (weight [N, K] * scale [N, 1])^T (+ bias), float32 on the CPU; into `out`
    ([rows, N]) if given. None where the kernel cannot take it (the caller dequantizes)."""
    module = w8_gemm()
    if module is None or x.dtype != torch.float32 or x.device.type != "cpu" or not weight.is_contiguous():
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.float32)
    module.w8_linear(x2, weight, scale, bias, out)
    return out.view(*lead, weight.shape[0])
