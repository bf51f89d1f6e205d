"""Fused elementwise/row kernels for the decode step: RMSNorm (+ residual add), RoPE (alone, or
with the step's KV write), SiLU-and-mul, and the copy of tokens scheduled ahead into a step's
input ids.

Each op is ONE Triton launch (the torch versions are 6-14 kernels per layer, and a CUDA-graph
decode step is launch-bound). Everything the launch needs is derived from shapes and strides
on the host, so the wrappers never sync and are safe to capture in a CUDA graph.

Numerics: math is done in float32 and rounded to the tensor dtype once, except where the
transformers formula itself rounds (RMSNorm rounds the normalised row to the input dtype
before multiplying by the weight; the residual sum is rounded before it is normalised), which
is reproduced so the results track the reference to the last bit or two.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The whole row is held in registers (one load, one store per element). Llama hidden sizes
# stop at 16384 (405B): 32 fp32 values per thread at 16 warps. Past 32768 the row would spill;
# no supported model needs a looped two-pass variant.
_MAX_ROW = 32768

# Under Triton's CPU interpreter (tests). Its float32 -> bfloat16 cast truncates where the GPU's
# cvt.rn rounds to nearest even, so `_round` emulates RTNE with integer bit arithmetic there;
# and it has no libdevice, so `_silu_and_mul_kernel` falls back to tl.exp. Both branches are
# compiled out on a GPU.
_INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to nearest even in `dtype`."""
    if _INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # ties to even; finite inputs only
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


def _row_warps(block: int) -> int:
    """Warps for a row of `block` elements: 8 per thread (one 16-byte vector for 16-bit
    dtypes), clamped to 1..16 warps (hidden 2048 -> 8 warps, 4096 / 8192 -> 16)."""
    return max(1, min(16, block // (32 * 8)))


# ----------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, w_ptr, x_stride, res_stride, out_stride, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row; the whole row stays in registers, so it is read once and written
    # once (twice with the residual) and the in-place fused variant is race-free.
    row = tl.program_id(0).to(tl.int64)  # int64: rows * stride can pass 2^31 in long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # torch's `x + residual` rounds the sum to the dtype; the norm then reads the rounded sum.
        s = _round(x + r, dtype)
        tl.store(res_ptr + row * res_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols  # masked lanes are 0, so they add nothing
    y = _round(x * tl.math.rsqrt(var + eps), dtype)  # LlamaRMSNorm rounds before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _round(w * y.to(tl.float32), dtype), mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> None:
    assert x.dim() == 2 and x.stride(-1) == 1 and out.stride(-1) == 1, "rows must be contiguous"
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous()
    block = triton.next_power_of_2(hidden)
    assert block <= _MAX_ROW, f"hidden {hidden} too wide for the one-block row kernel"
    if num_tokens == 0:
        return
    res = residual if residual is not None else x  # dummy pointer when HAS_RESIDUAL is off
    _rms_norm_kernel[(num_tokens,)](
        x, res, out, weight, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden] (contiguous rows); returns a new tensor, same dtype.

    As transformers' LlamaRMSNorm: in float32, var = mean(x^2), y = x * rsqrt(var + eps),
    y rounded to x.dtype first, then out = weight * y in float32, rounded to x.dtype.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, out, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- (x + residual) rounded to the dtype (exactly torch's `x + residual`);
    x <- rms_norm(new residual). One pass over the row (vLLM's fused_add_rms_norm).
    x, residual: [num_tokens, hidden], same dtype, contiguous rows."""
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    _launch_rms_norm(x, residual, x, weight, eps)


# ----------------------------------------------------------------------------- the KV cache's values

@triton.jit
def quantize_kv(x, scale, dtype: tl.constexpr, FP8: tl.constexpr):
    # x as the cache of `dtype` stores it: fp8(clamp(x * (1 / scale), +-448)) for an FP8 cache (the
    # clamp saturates an outlier rather than turning it into NaN), else x cast (kv_quant.quantize,
    # whose torch division by a scalar is this multiplication by its reciprocal).
    if FP8:
        x = tl.clamp(x.to(tl.float32) * (1.0 / scale), -448.0, 448.0)
        if _INTERPRET:
            x = _round_e4m3(x)
    return x.to(dtype)


@triton.jit
def _round_e4m3(x):
    # Under TRITON_INTERPRET=1 (triton 3.9) float32 -> e4m3 loses the carry into the next binade
    # (0.4946 -> 0.25) and rounds subnormals wrongly, so x is first rounded to nearest even onto
    # e4m3's grid in float32 (3 mantissa bits; below 2^-6 multiples of 2^-9, rounded by adding
    # 2^14, whose float32 ulp is 2^-9), which the cast then takes exactly. |x| <= 448.
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    r = tl.where(a < 0.015625, (a + 16384.0) - 16384.0, bits.to(tl.float32, bitcast=True))
    return tl.where(x < 0, -r, r)


@triton.jit
def load_kv(ptrs, mask, scale, dtype: tl.constexpr, FP8: tl.constexpr):
    # A K or V tile in the compute `dtype`: an FP8 cache's values dequantized in registers,
    # float(x) * scale rounded once (kv_quant.dequantize).
    x = tl.load(ptrs, mask=mask, other=0.0)
    if FP8:
        x = (x.to(tl.float32) * scale).to(dtype)
    return x


# ----------------------------------------------------------------------------- RoPE

@triton.jit
def rotated_heads(base_ptr, token, tok_stride, head_stride, n_heads, cos_lo, sin_lo, cos_hi, sin_hi,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # All heads of one token rotated: (low halves, high halves), each a [BLOCK_H, BLOCK_HALF]
    # tile rounded once to the tensor's dtype, and the tiles' mask. cos_*/sin_*: [1, BLOCK_HALF]
    # float32 rows broadcast over the heads.
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    lo_ptr = base_ptr + token * tok_stride + heads * head_stride + dims
    x1 = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): out_lo = x1*cos - x2*sin, out_hi = x2*cos + x1*sin.
    dtype = base_ptr.dtype.element_ty
    return _round(x1 * cos_lo - x2 * sin_lo, dtype), _round(x2 * cos_hi + x1 * sin_hi, dtype), mask


@triton.jit
def head_tile(BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # (head index [BLOCK_H, 1], dim index [1, BLOCK_HALF]) of a `rotated_heads` tile.
    return tl.arange(0, BLOCK_H)[:, None], tl.arange(0, BLOCK_HALF)[None, :]


@triton.jit
def _rope_heads(base_ptr, token, tok_stride, head_stride, n_heads, cos_lo, sin_lo, cos_hi, sin_hi,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Rotates all heads of one token in place.
    lo, hi, mask = rotated_heads(base_ptr, token, tok_stride, head_stride, n_heads, cos_lo, sin_lo, cos_hi,
                                 sin_hi, HALF, BLOCK_H, BLOCK_HALF)
    heads, dims = head_tile(BLOCK_H, BLOCK_HALF)
    lo_ptr = base_ptr + token * tok_stride + heads * head_stride + dims
    tl.store(lo_ptr, lo, mask=mask)
    tl.store(lo_ptr + HALF, hi, mask=mask)


@triton.jit
def rope_row(cos_ptr, sin_ptr, pos, cs_stride, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Position `pos`'s (cos_lo, sin_lo, cos_hi, sin_hi), each [1, BLOCK_HALF] float32. Both
    # halves of the table are read (not assumed duplicated), so any table gives the reference's
    # exact operands.
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = dims < HALF
    cs_row = pos * cs_stride + dims
    cos_lo = tl.load(cos_ptr + cs_row, mask=dmask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + cs_row + HALF, mask=dmask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + cs_row, mask=dmask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + cs_row + HALF, mask=dmask, other=0.0).to(tl.float32)
    return cos_lo, sin_lo, cos_hi, sin_hi


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])  # a view into a step's packed inputs
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, pos_stride,
                 q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, cs_stride,
                 n_q_heads, n_k_heads,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    # One program per token does q and k: the cos/sin row is gathered once for both.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token * pos_stride).to(tl.int64)  # int32 or int64 positions
    cos_lo, sin_lo, cos_hi, sin_hi = rope_row(cos_ptr, sin_ptr, pos, cs_stride, HALF, BLOCK_HALF)
    _rope_heads(q_ptr, token, q_tok_stride, q_head_stride, n_q_heads, cos_lo, sin_lo, cos_hi, sin_hi,
                HALF, BLOCK_HQ, BLOCK_HALF)
    _rope_heads(k_ptr, token, k_tok_stride, k_head_stride, n_k_heads, cos_lo, sin_lo, cos_hi, sin_hi,
                HALF, BLOCK_HK, BLOCK_HALF)


# The positions and the slot mapping are views into a step's packed inputs (per-step offsets).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                          q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, v_tok_stride, v_head_stride,
                          cs_stride, c_slot_stride, c_head_stride, n_q_heads, n_kv_heads, k_scale, v_scale,
                          HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr,
                          BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                          KV_FP8: tl.constexpr):
    # One program per token: q rotated in place; k rotated straight into its cache slot (by
    # `rotated_heads`, as RoPE alone rotates, so the cache holds exactly the keys that RoPE
    # then `write_kv` would write); v copied into its slot. slot < 0 (a padding row)
    # writes nothing to the caches.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos_lo, sin_lo, cos_hi, sin_hi = rope_row(cos_ptr, sin_ptr, pos, cs_stride, HALF, BLOCK_HALF)
    _rope_heads(q_ptr, token, q_tok_stride, q_head_stride, n_q_heads, cos_lo, sin_lo, cos_hi, sin_hi,
                HALF, BLOCK_HQ, BLOCK_HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        k_lo, k_hi, mask = rotated_heads(k_ptr, token, k_tok_stride, k_head_stride, n_kv_heads, cos_lo, sin_lo,
                                         cos_hi, sin_hi, HALF, BLOCK_HK, BLOCK_HALF)
        heads, dims = head_tile(BLOCK_HK, BLOCK_HALF)
        cache_dtype = k_cache_ptr.dtype.element_ty
        dst = k_cache_ptr + slot * c_slot_stride + heads * c_head_stride + dims
        tl.store(dst, quantize_kv(k_lo, k_scale, cache_dtype, KV_FP8), mask=mask)
        tl.store(dst + HALF, quantize_kv(k_hi, k_scale, cache_dtype, KV_FP8), mask=mask)
        cols = tl.arange(0, BLOCK_D)[None, :]
        v_mask = (heads < n_kv_heads) & (cols < HEAD_DIM)
        v = tl.load(v_ptr + token * v_tok_stride + heads * v_head_stride + cols, mask=v_mask)
        tl.store(v_cache_ptr + slot * c_slot_stride + heads * c_head_stride + cols,
                 quantize_kv(v, v_scale, cache_dtype, KV_FP8), mask=v_mask)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """In place rotate-half RoPE (Llama/HF): x <- x * cos[pos] + rotate_half(x) * sin[pos].

    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; may be
    strided views into one fused qkv output (only the last dim must be contiguous).
    cos, sin: [max_positions, head_dim]; positions: int32/int64 [num_tokens]. One launch.
    """
    num_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    assert k.shape == (num_tokens, n_k, head_dim) and k.dtype == q.dtype and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert cos.shape == sin.shape and cos.shape[-1] == head_dim and cos.stride(-1) == 1
    assert cos.stride(0) == sin.stride(0) and sin.stride(-1) == 1
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    # ~4 elements per thread in the bigger (q) tile: 32 heads x 64 -> 2048 -> 4 warps.
    num_warps = max(1, min(8, block_hq * block_half // 512))
    _rope_kernel[(num_tokens,)](
        q, k, cos, sin, positions, positions.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), n_q, n_k,
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=num_warps)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`rope_(q, k, ...)` then `write_kv(k, v, ...)` (triton_attention.py) in one launch: q is
    rotated in place, the rotated k and v go into their cache slots (slot < 0 skipped). k itself
    is left as it was: on the kernels' path attention reads keys from the cache only.

    q [num_tokens, num_heads, head_dim], k / v [num_tokens, num_kv_heads, head_dim] (strided
    views of a fused qkv output; last dim contiguous); caches [slots, num_kv_heads, head_dim];
    positions, slot_mapping int32/int64 [num_tokens] (contiguous). An FP8 cache (float8_e4m3fn)
    stores k and v quantized with `k_scale` / `v_scale` (workers/kernels/kv_quant.py)."""
    num_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    assert k.shape == (num_tokens, n_k, head_dim) and v.shape == k.shape and head_dim % 2 == 0
    assert k.dtype == q.dtype and v.dtype == q.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert cos.shape == sin.shape and cos.shape[-1] == head_dim and cos.stride(-1) == 1
    assert cos.stride(0) == sin.stride(0) and sin.stride(-1) == 1
    assert key_cache.shape[1:] == k.shape[1:] and value_cache.shape == key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(2) == 1
    assert positions.shape == (num_tokens,) and positions.stride(0) == 1
    assert positions.dtype in (torch.int32, torch.int64) and slot_mapping.dtype in (torch.int32, torch.int64)
    assert slot_mapping.shape[0] >= num_tokens and slot_mapping.stride(0) == 1
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    num_warps = max(1, min(8, block_hq * block_half // 512))  # as rope_: q's tile is the bigger
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, positions, slot_mapping, key_cache, value_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), key_cache.stride(0), key_cache.stride(1), n_q, n_k, k_scale, v_scale,
        HALF=half, HEAD_DIM=head_dim, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=num_warps)


# ----------------------------------------------------------------------------- SiLU and mul

_SILU_BLOCK = 1024  # columns per program: 4 warps x 32 lanes x 8 (one 16-byte bf16 vector each)


@triton.jit
def _silu_and_mul_kernel(in_ptr, out_ptr, in_stride, out_stride, d, BLOCK: tl.constexpr):
    # Grid (rows, column blocks): a single decode row of d = 14336 still spreads over 14 SMs.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + row * in_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) * up in float32, rounded once below. tl.exp is ex2.approx(g * log2e), whose
    # error grows with |g| (~7 float32 ulps at |g| = 10); libdevice's expf and an IEEE divide
    # are what torch's CUDA silu uses, and cost nothing in this memory-bound kernel.
    if _INTERPRET:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    out = tl.math.div_rn(g, 1.0 + e) * u
    tl.store(out_ptr + row * out_stride + cols, _round(out, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * d] (gate | up); returns silu(gate) * up: [num_tokens, d],
    same dtype, computed in float32 and rounded once."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(-1) == 1
    num_tokens, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(d))
    num_warps = max(1, min(4, block // 256))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), d, BLOCK=block, num_warps=num_warps)
    return out


# ----------------------------------------------------------------------------- tokens scheduled ahead

_PENDING_BLOCK = 128  # rows a loop iteration copies; one program, one compile, for any count


# The index views are slices of a step's packed inputs (per-step offsets and counts).
@triton.jit(do_not_specialize=["num"], do_not_specialize_on_alignment=["dst_ptr", "src_ptr"])
def _copy_pending_kernel(ids_ptr, dst_ptr, src_ptr, tokens_ptr, num, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(0, num, BLOCK):
        mask = start + offs < num
        dst = tl.load(dst_ptr + start + offs, mask=mask, other=0)
        src = tl.load(src_ptr + start + offs, mask=mask, other=0)
        token = tl.load(tokens_ptr + src, mask=mask, other=0)
        tl.store(ids_ptr + dst, token.to(ids_ptr.dtype.element_ty), mask=mask)


def copy_pending(input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """input_ids[dst[i]] = tokens[src[i]] for every i, in one launch: the tokens of requests
    scheduled ahead, from the last step's sampled ids (any integer dtype) into this step's
    input ids (where index_select, two index casts, a dtype cast and index_copy_ take five).
    dst / src: int32 [n], contiguous."""
    num = dst.shape[0]
    assert src.shape == (num,) and dst.stride(0) == 1 and src.stride(0) == 1 and input_ids.stride(0) == 1
    if num == 0:
        return
    _copy_pending_kernel[(1,)](input_ids, dst, src, tokens, num, BLOCK=_PENDING_BLOCK, num_warps=4)
