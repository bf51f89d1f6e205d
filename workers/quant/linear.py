"""Quantized weights of one linear layer: where the scales live, how they load, and the product.

A quantized layer (workers/model/layers.py's column- and row-parallel linears) holds

    weight        [out, in] int8 or float8_e4m3fn: this rank's shard, as the checkpoint stores it
    weight_scale  float32 [out]: one scale per output row of this rank's shard (a per-tensor
                  checkpoint scale is spread over its rows: the same dequantized values, and a
                  fused q|k|v or gate|up keeps each part's own scale); or, block-wise,
                  [out / block rows, in / block cols]
    input_scale   float32 [1], static activations only: the largest of the fused parts'

so a weight dequantizes as weight * weight_scale[:, None] (blocks: each block times its scale).
Scales shard with their weights: column-parallel layers take their rows' scales, row-parallel
layers (whose shard is a slice of the input columns) keep every row's scale, block scales are
cut along whichever axis the weight is. Pipeline stages build, and so load, only their layers.

The product, by device and scheme:

    CPU, float32      csrc/w8_gemm.cpp: weights converted in registers, the scale after the sum;
                      W8A8 rounds x to FP8 per token first, so the values are a GPU's
    CUDA, W8A8 FP8    torch._scaled_mm on FP8 x (dynamic per-token or static scales) and FP8 W,
                      row-wise scales, where the GPU multiplies FP8 (sm_89+); weight-only below
    otherwise         dequantize, then the model dtype's GEMM (block-wise FP8 everywhere)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.kernels import gpu_kernels
from tandem.workers.kernels.w8_gemm import w8_linear
from tandem.workers.quant.scheme import QuantScheme

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value: quantization saturates here, never to NaN
INT8_MAX = 127.0  # symmetric: -127..127, as every format here stores it
STORAGE_DTYPES = {"fp8": FP8, "int8": torch.int8}


def init_params(module: nn.Module, out_features: int, in_features: int, scheme: QuantScheme) -> None:
    """Give `module` empty quantized parameters for a [out_features, in_features] shard."""
    module.quant = scheme
    module.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=STORAGE_DTYPES[scheme.weight_dtype]),
                                 requires_grad=False)
    if scheme.block is not None:
        rows, cols = scheme.block
        if out_features % rows or in_features % cols:
            raise ValueError(f"quantization: a {out_features} x {in_features} weight shard does not split into "
                             f"{rows} x {cols} scale blocks (block-wise FP8 needs every shard in whole blocks)")
        scale_shape: tuple[int, ...] = (out_features // rows, in_features // cols)
    else:
        scale_shape = (out_features,)
    module.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
    module.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False) \
        if scheme.activations == "static" else None


def load_row_scales(param: torch.Tensor, source: Any, start: int, size: int, offset: int,
                    block: tuple[int, int] | None) -> None:
    """A column-parallel part's scales: the checkpoint's rows [start, start + size) into param's
    rows [offset, offset + size) (block-wise: the blocks those rows make). A per-tensor scale
    fills them: a fused layer's parts keep their own."""
    if block is not None:
        start, size, offset = start // block[0], size // block[0], offset // block[0]
    dest = param.data[offset:offset + size]
    if _numel(tuple(source.shape)) == 1:
        dest.fill_(float(source[...].reshape(-1)[0]))
    else:
        dest.copy_(source[start:start + size].reshape(dest.shape))


def load_col_scales(param: torch.Tensor, source: Any, start: int, end: int, block: tuple[int, int] | None) -> None:
    """A row-parallel layer's scales: every output row's (per-channel or per-tensor), or the
    blocks of its input columns [start, end)."""
    if _numel(tuple(source.shape)) == 1:
        param.data.fill_(float(source[...].reshape(-1)[0]))
    elif block is not None:
        param.data.copy_(source[:, start // block[1]:end // block[1]])
    else:
        param.data.copy_(source[...].reshape(param.shape))


def load_input_scale(param: torch.Tensor, source: Any) -> None:
    """A fused layer's parts share one activation scale: the largest of theirs (vLLM's rule),
    so no part's input overflows."""
    value = float(source[...].reshape(-1).max())
    param.data.fill_(max(value, float(param.data[0])))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def dequantized(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight in `dtype`: weight times its scales."""
    w = module.weight.to(torch.float32)
    scale = module.weight_scale
    if module.quant.block is not None:
        rows, cols = module.quant.block
        scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return (w * scale).to(dtype)
    return (w * scale[:, None]).to(dtype)


def quantize_activations(x: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 x, float32 scales [M, 1]): per token from its largest magnitude
    (dynamic, capped by the checkpoint's bound where it has one), or the static scale."""
    scheme = module.quant
    if scheme.activations == "static":
        scale = module.input_scale.reshape(1, 1).expand(x.shape[0], 1)
    else:
        amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
        if scheme.activation_scale_ub is not None:
            amax = amax.clamp(max=scheme.activation_scale_ub)
        scale = (amax / FP8_MAX).clamp(min=1e-12)  # an all-zero row: any scale, not 0/0
    q = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quant_linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for a quantized layer; into `out` ([rows, out_features]) where given."""
    lead = x.shape[:-1]
    return _product(module, x.reshape(-1, x.shape[-1]), bias, out).view(*lead, -1)


def _product(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
             ) -> torch.Tensor:
    scheme: QuantScheme = module.quant
    if scheme.block is not None:  # block-wise FP8: dequantized weight; W8A8 rounds x per token per block
        xin = x if scheme.weight_only else _rounded_groups(x, scheme.block[1])
        return _dequantized_product(module, xin, bias, out)
    fp8_cores = _multiplies_fp8(x)
    if not scheme.weight_only and fp8_cores:
        y = _scaled_mm(module, x, bias)
        if y is not None:
            return _into(y, out)
    # W8A8 keeps its numerics on the CPU (x rounded to FP8 per token, as the GPU's are); a GPU
    # without FP8 tensor cores runs such a layer weight-only.
    xin = x
    if not scheme.weight_only and (fp8_cores or x.device.type == "cpu"):
        xin = _dequantize(*quantize_activations(x, module), x.dtype)
    if gpu_kernels.active_for(x) is not None:
        from tandem.workers.kernels.triton_w8 import MAX_ROWS, w8_matmul  # Triton: imported where it runs

        if x.shape[0] <= MAX_ROWS:
            return w8_matmul(xin, module.weight, module.weight_scale, bias, out)
    y = w8_linear(xin, module.weight, module.weight_scale, bias, out)
    if y is not None:
        return y
    return _dequantized_product(module, xin, bias, out)


def _dequantized_product(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                         out: torch.Tensor | None) -> torch.Tensor:
    return _into(F.linear(x, dequantized(module, x.dtype), bias), out)


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def _rounded_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return _dequantize(*_quantize_groups(x, group), x.dtype)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 activations and their scales back to `dtype`: x as W8A8 rounds it."""
    return (q.to(torch.float32) * scale).to(dtype)


def _quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8's activations: per token, per `group` columns (DeepSeek's 1 x 128)."""
    m, k = x.shape
    g = x.to(torch.float32).view(m, k // group, group)
    scale = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, k), scale.repeat_interleave(group, dim=1).view(m, k)


def _multiplies_fp8(x: torch.Tensor) -> bool:
    """Whether x's device has FP8 tensor cores (CUDA sm_89+)."""
    return x.device.type == "cuda" and _fp8_cores(x.device.index or 0)


@functools.cache
def _fp8_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _scaled_mm(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """W8A8 on FP8 tensor cores, or None where _scaled_mm's shape rules refuse this layer
    (both dims of W multiples of 16)."""
    n, k = module.weight.shape
    if n % 16 or k % 16:
        return None
    q, scale = quantize_activations(x, module)
    return torch._scaled_mm(q, module.weight.t(), scale_a=scale, scale_b=module.weight_scale.view(1, n),
                            bias=bias, out_dtype=x.dtype)


# ---- quantizing at load ------------------------------------------------------------------------
def quantize_weight(weight: torch.Tensor, weight_dtype: str,
                    row_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision [out, in] weight -> (8-bit weight, float32 scale [out]): symmetric, per
    output row, from the row's largest magnitude (`row_amax` where the row spans other ranks)."""
    w = weight.to(torch.float32)
    amax = row_amax if row_amax is not None else w.abs().amax(dim=1)
    top = FP8_MAX if weight_dtype == "fp8" else INT8_MAX
    scale = (amax / top).clamp(min=1e-12)
    scaled = w / scale[:, None]
    if weight_dtype == "fp8":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_module(module: nn.Module, scheme: QuantScheme, row_amax: torch.Tensor | None = None) -> None:
    """Replace a loaded full-precision layer's weight by its quantized one (online schemes)."""
    q, scale = quantize_weight(module.weight.data, scheme.weight_dtype, row_amax)
    module.quant = scheme
    module.weight = nn.Parameter(q.contiguous(), requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)
    module.input_scale = None
    module.packed = None
