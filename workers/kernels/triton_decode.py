"""Paged flash-decoding in Triton: one query token per sequence against the paged KV cache.

Stage 1 (`_decode_split_kernel`): one program per (row, kv_head, split). The split ranges are
computed in the kernel from seq_lens, so one host-fixed `num_splits` serves every row length
and every CUDA-graph replay. The program loads each key/value tile once for all G query heads
of its KV head (the G heads are the M side of tl.dot, padded to 16, the smallest tl.dot M).
Stage 2 (`_decode_combine_kernel`) merges the splits' partial outputs by their log-sum-exp.
With num_splits == 1 stage 1 writes `out` directly and stage 2 is skipped.

With ROPE (`DecodeRope`), stage 1 also applies RoPE and writes the step's K/V: each program
rotates its G query heads as it loads them, and the split holding the row's new position
writes the rotated key and the value to their slot before it reads any key. A decode layer's
attention is then one launch where it would be two (RoPE + KV write, then attention). q and
the cache get the same bits as the two launches give (`_rotate_and_write_new_kv`); the output
agrees to the last bit of its dtype, not always to the bit: on a GPU the two are different
programs, whose FMA contractions and dot layouts round the softmax differently.

An FP8 cache (float8_e4m3fn) is read through `load_kv`: each K/V tile is dequantized in
registers (float(x) * scale, rounded to the query's dtype) before its dot, and the fused KV write
quantizes (`quantize_kv`); the scales are launch arguments.

Scores live in the log2 domain (scale * log2(e) folded into the exp2 argument, one FMA per
score) so the softmax uses exp2, a single MUFU instruction on NVIDIA GPUs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.workers.kernels.decode_splits import default_num_splits
from tandem.workers.kernels.triton_ops import head_tile, load_kv, quantize_kv, rope_row, rope_write_kv, rotated_heads

LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima: exp2(-inf - NEG_BIG) is 0 and
# exp2(NEG_BIG - NEG_BIG) is 1, so rows that have seen no key yet need no NaN guards.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


def head_dim_block(head_dim: int) -> int:
    """head_dim padded to a power of two (masked), at least 16: tl.dot's smallest K/N."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would silently run as tf32 on tensor cores (10-bit mantissa); ask for
    exact fp32 products there. 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 or interpreter_upcast(dtype) else "tf32"


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 tl.dot operands as their raw uint16 bits (seen
    with triton 3.9), so under TRITON_INTERPRET=1 bf16 tiles are cast to fp32 before each dot.
    Never on a GPU, where bf16 goes to the tensor cores as is."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


# Rows x KV heads from which a decode launch over 128-byte rows takes 64-key tiles: about four
# programs an SM before splits on an H100's 132 SMs (bench/RESULTS.md has the sweeps).
SHORT_TILE_ROWS = 512


def decode_tile(block_d: int, elem_size: int, row_heads: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages) for the split kernel, for `row_heads` =
    rows x KV heads in the launch.

    Decode only streams the cache. Built for sm_90 the block-table -> slot -> row gathers are
    not staged through shared memory, which holds the dot operands only, so what a tile costs
    is registers. 16-bit rows of 64 dims (128 bytes) take 4 warps and 2 stages, which beat 8
    warps and 3 stages at every such shape the H100 sweeps measured, with 128-key tiles (16 KB
    of K) where few rows leave the GPU to long splits and 64-key ones where many rows fill it,
    which waste less of a short context's last tile and let more programs reside (batch 128
    of 8 KV heads, 160 keys: 1.76x the 128x8x3 tile; level with 128 keys at 2048). Rows of 128
    dims take 64-key tiles (16 KB) at every batch: faster than 128x8x3 everywhere measured but
    batch 128 x 2048 keys (1% slower), and within 8% of the best tile. Wider rows shrink the
    tile (`bench/decode_tiles.py` sweeps it on a GPU).
    """
    row_bytes = block_d * elem_size
    if row_bytes <= 128:
        return (64 if row_heads >= SHORT_TILE_ROWS else 128), 4, 2
    if row_bytes <= 256:
        return 64, 4, 2
    if row_bytes <= 512:
        return 64, 8, 3
    return 32, 4, 3


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v_ptrs, v_mask, qk_scale, v_scale, dtype: tl.constexpr,
                        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr):
    """Fold one tile into the running (acc [M, D], l [M], m [M]): s [M, N] are its raw scores
    (-inf where masked), v_ptrs [N, D] its values (an FP8 cache's dequantized to `dtype`, the
    query's). The scale is folded into the exp2 argument (one FMA per score); m stays finite
    (NEG_BIG start), so a row seeing no key of the tile gets p = 0 and alpha = 1 rather than NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv(v_ptrs, v_mask, v_scale, dtype, KV_FP8)          # [N, D]
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _rotate_and_write_new_kv(q_ptr, k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr,
                             v_cache_ptr, b64, kvh, seq_len, start, end, head_off, stride_qb, stride_qh,
                             stride_kb, stride_kh, stride_vb, stride_vh, stride_rope, stride_cs, k_scale, v_scale,
                             G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, KV_FP8: tl.constexpr):
    """RoPE and the KV write of a decode row, inside the attention launch: this program's G query
    heads rotated (returned as the [BLOCK_G, BLOCK_D] q tile), and, by the one split whose keys
    hold the row's new position (seq_len - 1), the rotated key and the value of its KV head
    written to their cache slot (slot < 0: a padding row, nothing written) before any key is
    read. Both rotate through `rotated_heads`, as `rope_write_kv` does, so q and the cache get
    the same bits as that launch does. HEAD_DIM == BLOCK_D (a power of two): the two rotated
    halves are joined into one tile."""
    HALF: tl.constexpr = BLOCK_D // 2
    pos = tl.load(pos_ptr + b64).to(tl.int64)
    cos_lo, sin_lo, cos_hi, sin_hi = rope_row(cos_ptr, sin_ptr, pos, stride_rope, HALF, HALF)
    lo, hi, _ = rotated_heads(q_ptr + kvh * G * stride_qh, b64, stride_qb, stride_qh, G, cos_lo, sin_lo, cos_hi,
                              sin_hi, HALF, BLOCK_G, HALF)
    q = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_G, BLOCK_D))  # [lo | hi] per head
    slot = tl.load(slot_ptr + b64).to(tl.int64)
    new = seq_len - 1
    if (slot >= 0) & (start <= new) & (new < end):
        # Two head rows (the second masked off): the smallest tile `rotated_heads` is given.
        k_lo, k_hi, mask = rotated_heads(k_new_ptr + kvh * stride_kh, b64, stride_kb, stride_kh, 1, cos_lo, sin_lo,
                                         cos_hi, sin_hi, HALF, 2, HALF)
        heads, dims = head_tile(2, HALF)
        cache_dtype = k_cache_ptr.dtype.element_ty
        dst = slot * stride_cs + head_off + heads * 0 + dims
        tl.store(k_cache_ptr + dst, quantize_kv(k_lo, k_scale, cache_dtype, KV_FP8), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, quantize_kv(k_hi, k_scale, cache_dtype, KV_FP8), mask=mask)
        cols = tl.arange(0, BLOCK_D)
        v = tl.load(v_new_ptr + b64 * stride_vb + kvh * stride_vh + cols)
        tl.store(v_cache_ptr + slot * stride_cs + head_off + cols, quantize_kv(v, v_scale, cache_dtype, KV_FP8))
    # The key tiles below read the slot just written: every thread's store lands first.
    tl.debug_barrier()
    return q


# Arguments that change from step to step are not specialised on (Triton would compile a new
# variant when one happens to be 1 or a multiple of 16), nor is the alignment of the tables,
# which are views into a step's packed inputs at per-step offsets (16-byte aligned or not):
# one compile per model, at start-up.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "pos_ptr", "slot_ptr"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,   # ROPE only
    qk_scale, window, num_splits, k_scale, v_scale,
    stride_qb, stride_qh,          # query [B, H, D], last dim contiguous
    stride_cs, stride_ch,          # caches [slots, kv_heads, D], last dim contiguous
    stride_bt,                     # block_tables [B, max_blocks]
    stride_ob, stride_oh,          # out [B, H, D]
    stride_kb, stride_kh, stride_vb, stride_vh, stride_rope,   # ROPE: new k, v [B, kv_heads, D]; cos/sin rows
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, ROPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * G

    seq_len = tl.load(seq_lens_ptr + b)
    # Sliding window: only keys at positions >= seq_len - window are visible.
    kv_lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Whole tiles per split, so no split reads a partial tile except the row's last one;
    # trailing splits of short rows get an empty range and only write an empty result.
    n_tiles = tl.cdiv(seq_len - kv_lo, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    start = kv_lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    heads = kvh * G + offs_g                                     # [BLOCK_G] query heads
    b64 = b.to(tl.int64)

    head_off = kvh * stride_ch
    if ROPE:
        q = _rotate_and_write_new_kv(q_ptr, k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr,
                                     v_cache_ptr, b64, kvh, seq_len, start, end, head_off, stride_qb, stride_qh,
                                     stride_kb, stride_kh, stride_vb, stride_vh, stride_rope, stride_cs, k_scale,
                                     v_scale, G, BLOCK_D, BLOCK_G, KV_FP8)
    else:
        q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)   # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b64 * stride_bt

    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n                                # [BLOCK_N] key positions
        n_mask = pos < end
        # Gather each key's slot through the block table: any block_size, any page order.
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_cs + head_off + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_kv(k_cache_ptr + kv_off, kv_mask, k_scale, q_ptr.dtype.element_ty, KV_FP8)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)     # [BLOCK_G, BLOCK_N] raw scores
        s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v_cache_ptr + kv_off, kv_mask, qk_scale, v_scale,
                                            q_ptr.dtype.element_ty, DOT_PREC, UPCAST, KV_FP8)

    # An empty range (padding row with seq_len 0, or a trailing split) has l_i == 0.
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Scratch: part_out [B, H, num_splits, HEAD_DIM] fp32, part_lse [B, H, num_splits].
        row = (b64 * num_heads + heads) * num_splits + split     # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    # All splits empty (seq_len 0): every weight is 0 and the output is 0, not NaN.
    m = tl.maximum(tl.max(lse, 0), NEG_BIG)
    w = tl.exp2(lse - m)                                         # [BLOCK_S]
    denom = tl.maximum(tl.sum(w, 0), 1e-30)
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)   # [BLOCK_S, BLOCK_D]
    o = tl.sum(parts * w[:, None], 0) / denom
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_mask)


class DecodeRope(NamedTuple):
    """What a decode launch needs to apply RoPE and write this step's K/V itself: the rows' new
    k and v ([B, kv_heads, head_dim], not yet rotated; strided views of a fused qkv output),
    the cos/sin tables ([max_positions, head_dim]), positions and slots ([B], int32/int64;
    slot < 0 writes nothing)."""
    key: torch.Tensor
    value: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor


def rope_fuses(head_dim: int) -> bool:
    """Whether the decode kernel applies RoPE itself: a power-of-two head_dim of at least 16
    (the rotated halves join into one tile with no padding between them)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                     window: int, out: torch.Tensor, num_splits: int, rope: DecodeRope | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Paged decode attention, written into `out` [B, num_heads, head_dim].

    query [B, num_heads, head_dim]; key_cache/value_cache [num_slots, num_kv_heads, head_dim];
    block_tables int32 [B, max_blocks]; seq_lens int32 [B] (including this step's token);
    window 0 = full context, else the last `window` keys. With `rope`, query is not rotated yet
    and this step's K/V are not in the cache: the launch rotates q and writes the rotated key
    and the value first (`rope_write_kv` then a plain decode, in one launch, where
    `rope_fuses(head_dim)`; the two launches elsewhere). An FP8 cache is read (and written) with
    `k_scale` / `v_scale`. No host syncs: CUDA-graph safe.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.shape[2] == head_dim and key_cache.stride(2) == 1
    # tl.dot takes one dtype on a GPU (the interpreter does not check): the cache is in the
    # model's dtype, or FP8, whose tiles are dequantized to the query's dtype first.
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    assert key_cache.dtype == query.dtype or kv_fp8, f"cache dtype {key_cache.dtype} is not the query's {query.dtype}"
    assert out.shape == query.shape and out.stride(2) == 1
    assert block_size >= 1 and block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert num_splits >= 1
    if batch == 0:
        return
    if rope is not None and not rope_fuses(head_dim):
        rope_write_kv(query, rope.key, rope.value, rope.cos, rope.sin, rope.positions, key_cache, value_cache,
                      rope.slot_mapping, k_scale, v_scale)
        rope = None
    if query.stride(2) != 1:
        query = query.contiguous()
    fused = rope is not None
    if fused:
        assert rope.key.shape == (batch, num_kv_heads, head_dim) and rope.value.shape == rope.key.shape
        assert rope.key.stride(2) == 1 and rope.value.stride(2) == 1 and rope.key.dtype == query.dtype
        assert rope.cos.shape == rope.sin.shape and rope.cos.shape[-1] == head_dim
        assert rope.cos.stride(-1) == 1 and rope.cos.stride(0) == rope.sin.stride(0) and rope.sin.stride(-1) == 1
        assert rope.positions.shape[0] >= batch and rope.positions.stride(0) == 1
        assert rope.slot_mapping.shape[0] >= batch and rope.slot_mapping.stride(0) == 1
        k_new, v_new, cos, sin, positions, slots = rope
    else:
        k_new = v_new = cos = sin = query  # unused placeholders, typed as the fused launch's
        positions = slots = seq_lens
    group = num_heads // num_kv_heads
    block_d = head_dim_block(head_dim)
    # Tiles sized by the query's element: an FP8 tile is widened to it in registers before its dot.
    block_n, warps, stages = decode_tile(block_d, query.element_size(), batch * num_kv_heads)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused placeholders
    else:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_out, part_lse,
        k_new, v_new, cos, sin, positions, slots,
        scale * LOG2E, window, num_splits, k_scale, v_scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0),
        G=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, DIRECT=direct, DOT_PREC=dot_precision(query.dtype),
        UPCAST=interpreter_upcast(query.dtype), ROPE=fused, KV_FP8=kv_fp8,
        num_warps=warps, num_stages=stages,
    )
    if not direct:
        _decode_combine_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if block_d >= 128 else 2,
        )


__all__ = [
    "LOG2E",
    "NEG_BIG",
    "DecodeRope",
    "decode_attention",
    "default_num_splits",
    "dot_precision",
    "head_dim_block",
    "interpreter_upcast",
    "rope_fuses",
]
