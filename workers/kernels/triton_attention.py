"""Triton attention kernels for CUDA over the paged KV cache.

Cache layout (per layer): key_cache / value_cache [num_slots, num_kv_heads, head_dim],
contiguous, num_slots = num_blocks * block_size; position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size.

- `write_kv`: scatter a step's K/V into their slots (one launch, slot < 0 skipped).

An FP8 cache (float8_e4m3fn) takes the layer's `k_scale` / `v_scale` in every wrapper: writes
store fp8(clamp(x / scale)), reads dequantize each tile in registers (triton_ops.py
`quantize_kv` / `load_kv`); the dots run in the query's dtype.
- `decode_attention` (triton_decode.py): one query token per row, flash-decoding splits; with
  `DecodeRope` it applies RoPE and writes the row's K/V itself, in the same launch.
- `prefill_attention` (triton_prefill.py): packed varlen causal queries, chunked prefill.
- `default_num_splits`: a split count for decode that fills the GPU.

Every wrapper is CUDA-graph capturable: no host syncs, scratch only via torch.empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels.triton_decode import DecodeRope, decode_attention, default_num_splits
from tandem.workers.kernels.triton_ops import quantize_kv
from tandem.workers.kernels.triton_prefill import prefill_attention


# The slot mapping is a view into a step's packed inputs at a per-step offset: not specialised
# on its alignment, or each new alignment would compile a variant mid-run.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, k_scale, v_scale,
    stride_kt, stride_kh,          # key [T, kv_heads, D], last dim contiguous
    stride_vt, stride_vh,          # value [T, kv_heads, D], last dim contiguous
    stride_cs, stride_ch,          # caches [slots, kv_heads, D], last dim contiguous
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding row (e.g. a CUDA-graph batch padded past its real tokens)
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, quantize_kv(k, k_scale, k_cache_ptr.dtype.element_ty, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst, quantize_kv(v, v_scale, v_cache_ptr.dtype.element_ty, KV_FP8), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key/value [num_tokens, kv_heads, head_dim] (may be strided views of a fused QKV output,
    last dim contiguous); slot_mapping int32/int64 [num_tokens]. One launch; slot < 0 skipped.
    An FP8 cache stores them quantized with `k_scale` / `v_scale`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape[0] >= num_tokens
    assert key_cache.shape[1:] == key.shape[1:] and value_cache.shape == key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(2) == 1
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    # ~2K elements per program: a 128-dim head row is 256 B, 8 heads fill one 4-warp program
    # with 16-byte accesses.
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, k_scale, v_scale,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )


__all__ = ["DecodeRope", "decode_attention", "default_num_splits", "prefill_attention", "write_kv"]
