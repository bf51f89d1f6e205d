"""Variable-length causal attention over a step's packed query tokens, keys from the paged cache.

One launch per step covers fresh prompts, chunked prefill (the chunk attends to the cached prefix
read through the block table, plus itself) and multi-token verification rows. A program owns
BLOCK_Q query tokens x the G query heads of one KV head (BLOCK_M = BLOCK_Q * G rows of the
tl.dot M side), so each K/V tile is gathered once per KV head. Key tiles wholly after the
block's last query or before its sliding window are never visited. An FP8 cache's tiles are
dequantized in registers (`load_kv`, triton_ops.py) to the query's dtype before their dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels.triton_decode import (
    LOG2E,
    NEG_BIG,
    dot_precision,
    head_dim_block,
    interpreter_upcast,
    online_softmax_step,
)
from tandem.workers.kernels.triton_ops import load_kv


def prefill_tile(block_d: int, elem_size: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages).

    Picked from a sweep on H100 (bf16, GQA 4, block_size 16; paged gathers, so no TMA; the
    figures are in bench/RESULTS.md): d=64: 128x64 tiles, 8 warps, 3 stages; d=128: 128x32,
    one warpgroup (4 warps), 3 stages; d=256: 64x32, 4 warps, 2 stages, so Q, the fp32
    accumulator and the K/V stages fit.
    fp32 inputs take exact (non-tensor-core) dots: small 64x32 tiles keep registers in check.
    BLOCK_M is at least next_pow2(G) so every program covers at least one query token.
    """
    if elem_size >= 4:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    elif block_d <= 64:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 32, 4, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    return max(block_m, triton.next_power_of_2(group)), block_n, warps, stages


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row, head_off, stride_cs,
                  qk_scale, lo, hi, k_scale, v_scale, dtype: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                  KV_FP8: tl.constexpr, MASKED: tl.constexpr):
    """Online-softmax update over keys [lo, hi). MASKED=False is for tiles every row of the
    block sees whole (below the causal diagonal, inside the window, hi - lo a multiple of
    BLOCK_N): no per-element mask, no partial-tile load masks. An FP8 cache's tiles are
    dequantized to `dtype`, the query's."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + offs_n                                # [BLOCK_N] key positions
        if MASKED:
            n_mask = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            blk = tl.load(bt_row + pos // BLOCK_SIZE)
            kv_mask = d_mask[None, :]
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # gathered through the block table
        kv_off = slot[:, None] * stride_cs + head_off + offs_d[None, :]
        k = load_kv(k_cache_ptr + kv_off, kv_mask, k_scale, dtype, KV_FP8)   # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)     # [BLOCK_M, BLOCK_N] raw scores
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= win_lo[:, None]) & n_mask[None, :]
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v_cache_ptr + kv_off, kv_mask, qk_scale, v_scale,
                                            dtype, DOT_PREC, UPCAST, KV_FP8)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["window", "stride_bt"],  # per-step values and views: see triton_decode.py
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "q_start_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, q_start_ptr, out_ptr,
    qk_scale, window, k_scale, v_scale,
    # Strides (every last dim is contiguous): query [T, H, D], caches [slots, kv_heads, D],
    # block_tables [S, max_blocks], out [T, H, D].
    stride_qt, stride_qh, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Reversed so the last query blocks (the most keys under a causal mask) start first.
    qb = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)

    q_begin = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_begin
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len                                        # cached prefix length

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_local = qb * BLOCK_Q + offs_m // G                         # [BLOCK_M] token in the sequence
    heads = kvh * G + offs_m % G                                 # [BLOCK_M] query head
    row_mask = (offs_m < BLOCK_Q * G) & (q_local < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx + q_local                                        # [BLOCK_M] absolute position
    tok = (q_begin + q_local).to(tl.int64)

    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this block can see: [kv_lo, kv_hi); per row, key <= q_pos and, with a window,
    # key > q_pos - window. Keys in [full_lo, first_pos] are seen by every row, so whole tiles
    # there skip masking; only the window's lower edge and the diagonal tiles are masked.
    first_pos = ctx + qb * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    kv_hi = last_pos + 1
    kv_lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    full_lo = tl.where(window > 0, tl.maximum(last_pos - window + 1, 0), 0)
    full_hi = full_lo + tl.maximum(first_pos + 1 - full_lo, 0) // BLOCK_N * BLOCK_N
    win_lo = tl.where(window > 0, q_pos - window + 1, 0)         # [BLOCK_M]

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch
    q_dtype = q_ptr.dtype.element_ty  # what an FP8 cache's tiles are dequantized to
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row,
                                  head_off, stride_cs, qk_scale, kv_lo, full_lo, k_scale, v_scale, q_dtype,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PREC, UPCAST, KV_FP8, MASKED=True)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row,
                                  head_off, stride_cs, qk_scale, full_lo, full_hi, k_scale, v_scale, q_dtype,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PREC, UPCAST, KV_FP8, MASKED=False)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row,
                                  head_off, stride_cs, qk_scale, full_hi, kv_hi, k_scale, v_scale, q_dtype,
                                  HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, DOT_PREC, UPCAST, KV_FP8, MASKED=True)

    # Every real row sees at least its own key, so l_i > 0 there; padded rows are not stored.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      max_query_len: int, block_size: int, scale: float, window: int,
                      out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Causal varlen attention for the packed query tokens of S sequences, into `out`.

    query/out [num_tokens, num_heads, head_dim]; key_cache/value_cache [num_slots, num_kv_heads,
    head_dim] (this step's K/V already written); block_tables int32 [S, max_blocks]; seq_lens
    int32 [S] (context after this step); query_start_loc int32 [S + 1]; max_query_len a host
    int bounding every q_len (sizes the grid). An FP8 cache is read with `k_scale` / `v_scale`.
    No host syncs: CUDA-graph safe.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.shape[2] == head_dim and key_cache.stride(2) == 1
    # tl.dot takes one dtype on a GPU (the interpreter does not check); FP8 tiles are dequantized first.
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    assert key_cache.dtype == query.dtype or kv_fp8, f"cache dtype {key_cache.dtype} is not the query's {query.dtype}"
    assert out.shape == query.shape and out.stride(2) == 1
    assert query_start_loc.shape[0] == num_seqs + 1
    assert block_size >= 1 and block_size & (block_size - 1) == 0, "block_size must be a power of two"
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return
    if query.stride(2) != 1:
        query = query.contiguous()
    group = num_heads // num_kv_heads
    block_d = head_dim_block(head_dim)
    block_m, block_n, warps, stages = prefill_tile(block_d, query.element_size(), group)  # FP8: widened tiles
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, window, k_scale, v_scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, DOT_PREC=dot_precision(query.dtype),
        UPCAST=interpreter_upcast(query.dtype), KV_FP8=kv_fp8, num_warps=warps, num_stages=stages,
    )


__all__ = ["prefill_attention"]
