"""8-bit weights on the GPU without FP8 activations: int8 (W8A16) or FP8 weight-only layers, and
FP8 W8A8 layers on GPUs without FP8 tensor cores.

One launch per layer reads each 8-bit weight once, converts it in registers to the activations'
dtype (exact: int8 and e4m3 values are bf16 / fp16 values) and multiplies on the tensor cores,
scaling each output column after the fp32 sum. A decode step, which reads every weight once,
so reads a quarter of float32's or half of bf16's bytes. Up to `MAX_ROWS` rows; larger products
(prefill chunks) dequantize the weight once and run the model dtype's GEMM, whose cost the
many rows share.

Under Triton's interpreter (TRITON_INTERPRET=1) the same kernel runs on CPU tensors: that is how
the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # past this a step's rows share one dequantized weight (the caller's path)


@triton.jit
def _w8_matmul_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                      HAS_BIAS: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
        if FP8:
            b = b.to(tl.float8e4nv, bitcast=True)
        b = b.to(a.dtype)
        if IEEE:  # float32 activations: no TF32 rounding
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] * scale [N, 1])^T (+ bias) for M <= MAX_ROWS; weight int8 or
    float8_e4m3fn (contiguous), scale float32 [N]; into `out` ([M, N]) if given."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.is_contiguous() and weight.shape[1] == k
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fp8 = weight.dtype == torch.float8_e4m3fn
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # tl.dot's smallest tile is 16
    block_n, block_k = 64, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w8_matmul_kernel[grid](x, weight.view(torch.uint8) if fp8 else weight, scale,
                            bias if bias is not None else scale, out, m, n, k, x.stride(0), out.stride(0),
                            HAS_BIAS=bias is not None, FP8=fp8, IEEE=x.dtype == torch.float32,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
