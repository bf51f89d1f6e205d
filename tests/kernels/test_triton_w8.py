"""The Triton 8-bit weight matmul (workers/kernels/triton_w8.py), through Triton's interpreter:
int8 and FP8 weights, row counts inside one tile and across tiles, bias, a strided output,
against x @ (w * scale)^T in float32."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.quant.linear import quantize_weight


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_w8_matmul_equals_the_dequantized_product(dtype: torch.dtype, rows: int) -> None:
    from tandem.workers.kernels.triton_w8 import w8_matmul

    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 200  # a partial tile of outputs and of K
    w = torch.randn(n, k, generator=gen)
    q, scale = quantize_weight(w, "int8" if dtype == torch.int8 else "fp8")
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    expected = x @ (q.float() * scale[:, None]).t() + bias
    torch.testing.assert_close(w8_matmul(x, q, scale, bias), expected, rtol=1e-5, atol=1e-4)
    wide = torch.full((rows, n + 6), float("nan"))
    w8_matmul(x, q, scale, None, wide[:, :n])  # rows at a stride wider than N
    torch.testing.assert_close(wide[:, :n], expected - bias, rtol=1e-5, atol=1e-4)
    assert wide[:, n:].isnan().all()
