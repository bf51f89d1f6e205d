"""The CPU 8-bit weight GEMM (csrc/w8_gemm.cpp): FP8 codes convert to exactly torch's values,
and every row count (the few-row passes, their remainders, the tiled GEMM from 16 rows) gives
x @ (w * scale)^T (+ bias) to float32 rounding of a differently ordered sum."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.w8_gemm import w8_gemm, w8_linear
from tandem.workers.quant.linear import quantize_weight

pytestmark = pytest.mark.skipif(w8_gemm() is None, reason="no C++ compiler here: the layers dequantize in torch")


def test_every_fp8_code_converts_to_torchs_value() -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaNs
    weight = torch.zeros(len(codes), 64, dtype=torch.uint8)
    weight[:, 17] = codes  # inside the vector loop, not its scalar tail
    weight = weight.view(torch.float8_e4m3fn)
    x = torch.zeros(1, 64)
    x[0, 17] = 1.0
    out = w8_linear(x, weight, torch.ones(len(codes)))
    assert torch.equal(out[0], weight[:, 17].float())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 40])
def test_product_equals_the_dequantized_weights(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 80, 200  # K not a multiple of the vector loop's 64: its scalar tail runs too
    w = torch.randn(n, k, generator=gen)
    q, scale = quantize_weight(w, "int8" if dtype == torch.int8 else "fp8")
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    expected = x @ (q.float() * scale[:, None]).t() + bias
    out = w8_linear(x, q, scale, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    into = torch.full((rows, n), float("nan"))
    assert w8_linear(x, q, scale, None, into) is not None
    torch.testing.assert_close(into, expected - bias, rtol=1e-5, atol=1e-4)


def test_inputs_the_kernel_does_not_take_are_left_to_the_caller() -> None:
    q = torch.zeros(4, 16, dtype=torch.int8)
    assert w8_linear(torch.zeros(2, 16, dtype=torch.bfloat16), q, torch.ones(4)) is None
    assert w8_linear(torch.zeros(2, 16), q.t().contiguous().t(), torch.ones(4)) is None  # column-major
    assert w8_linear(torch.zeros(2, 16), q, torch.ones(4)) is not None
