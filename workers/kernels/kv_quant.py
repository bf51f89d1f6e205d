"""The FP8 KV cache: its dtype, the per-layer K and V scales, and the torch quantize / dequantize.

With `kv_cache_dtype` fp8 the cache blocks are float8_e4m3fn and every attention layer has a
K scale and a V scale (`LlamaAttention.k_scale` / `v_scale`: python floats, 1.0 unless the
checkpoint has `self_attn.k_scale` / `v_scale`). A write stores fp8(clamp(x / scale, ±448));
a read gives float(x_fp8) * scale, rounded to the compute dtype. The Triton kernels do the same
in registers (triton_ops.py `quantize_kv` / `load_kv`).

The scales reach the kernels through the cache tensor: `bind_scales` points the key cache at
its layer (a weak reference), and `scales_of` reads the layer's attributes on every call, so a
loader that sets them after the cache is allocated is seen, and CUDA graphs captured after
loading bake the loaded values.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value; anything past it saturates rather than turning NaN
_SCALE_OWNER = "_tandem_kv_scale_owner"


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for `CacheConfig.kv_cache_dtype`."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: fp8(clamp(x / scale)) for an fp8 cache, else x in `dtype`."""
    if not is_fp8(dtype):
        return x.to(dtype)
    # x / scale as torch divides by a scalar: times its reciprocal (the kernels multiply alike).
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents in the compute `dtype`: float(x) * scale for an fp8 cache, else x itself."""
    if not is_fp8(x.dtype):
        return x
    return (x.float() * scale).to(dtype)


def storage(x: torch.Tensor) -> torch.Tensor:
    """The tensor to copy bytes through: torch has no fp8 index_copy_ on CPU, so fp8 goes as uint8."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x


def bind_scales(key_cache: torch.Tensor, layer: Any) -> None:
    """Let `scales_of(key_cache)` read `layer.k_scale` / `layer.v_scale` (weakly: no cycle)."""
    setattr(key_cache, _SCALE_OWNER, weakref.ref(layer))


def scales_of(key_cache: torch.Tensor) -> tuple[float, float]:
    """(k_scale, v_scale) of the layer owning this cache; (1.0, 1.0) for an unbound or float cache."""
    if not is_fp8(key_cache.dtype):
        return 1.0, 1.0
    ref = getattr(key_cache, _SCALE_OWNER, None)
    layer = ref() if ref is not None else None
    if layer is None:
        return 1.0, 1.0
    return layer.k_scale, layer.v_scale


def as_float_scale(value: float | torch.Tensor) -> float:
    """A checkpoint's scale (0-d or one-element tensor, or a float) as the python float the kernels take."""
    scale = float(value.float().reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)
    if not scale > 0.0 or scale == float("inf"):
        raise ValueError(f"KV cache scale must be a positive finite number, got {scale}")
    return scale
