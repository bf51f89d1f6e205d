"""Triton paged-attention kernels against a dense float64 torch reference.

Runs on CUDA when present, else through Triton's interpreter on CPU (TRITON_INTERPRET=1 must be
set before triton is imported, hence the environment line above the imports). Sizes are tiny:
the interpreter executes every program instance in Python.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.workers.kernels.triton_attention import (
    decode_attention,
    default_num_splits,
    prefill_attention,
    write_kv,
)
from tandem.workers.kernels.triton_decode import DecodeRope, rope_fuses
from tandem.workers.kernels.triton_ops import rope_write_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = 7.0
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# ----------------------------------------------------------------------------- helpers

def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V caches [num_slots, kv_heads, head_dim]: slots no sequence owns hold noise,
    so any read past a sequence's keys changes the result."""
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def make_block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator,
                      spare_blocks: int = 3) -> tuple[torch.Tensor, int]:
    """Shuffled, non-contiguous block tables int32 [S, max_blocks + 2]; the padding entries
    point at real (noise) blocks, so reading one would show in the output."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need + [1]) + 2
    rows, used = [], 0
    for n in need:
        row = perm[used:used + n]
        used += n
        pad = torch.randint(0, num_blocks, (width - n,), generator=gen).tolist()
        rows.append(row + pad)
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE), num_blocks


def gather(cache: torch.Tensor, table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Keys 0..length-1 of one sequence as float64 [length, kv_heads, head_dim]."""
    pos = torch.arange(length, device=cache.device)
    slots = table_row.long()[pos // block_size] * block_size + pos % block_size
    return cache[slots].double()


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float,
                  window: int) -> torch.Tensor:
    """Dense float64 reference: q [n, H, D], k/v [L, kv_heads, D]; query i at q_pos[i] sees
    keys in (q_pos[i] - window, q_pos[i]] (window 0 = no lower bound)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    qp = torch.tensor(q_pos, device=q.device)[:, None]
    visible = key_pos <= qp
    if window > 0:
        visible &= key_pos > qp - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


# ----------------------------------------------------------------------------- write_kv

@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_write_kv_scatters_and_skips_negative_slots(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, kv_heads, head_dim, num_slots = 6, 3, 24, 20
    # K and V as strided views of one fused [tokens, 2 * kv_heads, head_dim] projection.
    fused = torch.randn(tokens, 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, :kv_heads], fused[:, kv_heads:]
    key_cache = torch.full((num_slots, kv_heads, head_dim), SENTINEL, dtype=dtype, device=DEVICE)
    value_cache = key_cache.clone()
    slots = torch.tensor([13, -1, 0, 19, -5, 4], dtype=slot_dtype, device=DEVICE)

    write_kv(key, value, key_cache, value_cache, slots)

    assert key_cache.shape == (num_slots, kv_heads, head_dim)
    written = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    dest = slots[written].long()
    torch.testing.assert_close(key_cache[dest], key[written], rtol=0, atol=0)
    torch.testing.assert_close(value_cache[dest], value[written], rtol=0, atol=0)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[dest] = False
    assert bool((key_cache[untouched] == SENTINEL).all())
    assert bool((value_cache[untouched] == SENTINEL).all())


# ----------------------------------------------------------------------------- decode

DECODE_CASES = [
    # (group, kv_heads, head_dim, block_size, seq_lens, window, num_splits, dtype)
    pytest.param(1, 2, 16, 16, [1, 32, 45], 0, 1, torch.float32, id="mha-bs16-direct"),
    pytest.param(2, 2, 32, 4, [1, 8, 300, 0], 0, 3, torch.float32, id="gqa2-bs4-3splits-empty-row"),
    pytest.param(4, 1, 16, 1, [260, 6], 0, 3, torch.float32, id="gqa4-kv1-bs1"),
    pytest.param(4, 1, 24, 16, [20, 3], 0, 5, torch.float32, id="gqa4-more-splits-than-blocks"),
    pytest.param(2, 2, 16, 4, [300, 7, 1], 150, 3, torch.float32, id="window-smaller"),
    pytest.param(2, 1, 16, 16, [30, 5], 100, 1, torch.float32, id="window-larger"),
    pytest.param(2, 2, 32, 16, [270, 16], 0, 2, torch.bfloat16, id="bf16"),
    pytest.param(4, 2, 16, 4, [40, 9], 12, 1, torch.float16, id="fp16-window"),
]


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size,seq_lens,window,num_splits,dtype", DECODE_CASES)
def test_decode_matches_reference(group: int, kv_heads: int, head_dim: int, block_size: int,
                                  seq_lens: list[int], window: int, num_splits: int,
                                  dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + 31 * group + block_size)
    heads, batch = group * kv_heads, len(seq_lens)
    tables, num_blocks = make_block_tables(seq_lens, block_size, gen)
    key_cache, value_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    # out is a view into a bigger buffer: the rows past the batch must stay untouched.
    out_full = torch.full((batch + 2, heads, head_dim), SENTINEL, dtype=dtype, device=DEVICE)
    out = out_full[:batch]
    scale = head_dim ** -0.5

    decode_attention(query, key_cache, value_cache, tables, lens, block_size, scale, window, out,
                     num_splits=num_splits)

    assert out.shape == (batch, heads, head_dim) and out.dtype == dtype
    assert bool((out_full[batch:] == SENTINEL).all())
    tol = TOL[dtype]
    for b, n in enumerate(seq_lens):
        if n == 0:  # a padding row (CUDA-graph batch) attends to nothing: zeros, not NaN
            assert bool((out[b] == 0).all())
            continue
        k = gather(key_cache, tables[b], n, block_size)
        v = gather(value_cache, tables[b], n, block_size)
        ref = ref_attention(query[b:b + 1], k, v, [n - 1], scale, window)[0]
        torch.testing.assert_close(out[b].double(), ref, rtol=tol, atol=tol)


FUSED_ROPE_CASES = [
    # (group, kv_heads, head_dim, block_size, seq_lens, window, num_splits, dtype, cache_dtype)
    pytest.param(2, 2, 16, 4, [1, 9, 300], 0, 1, torch.float32, torch.float32, id="fp32-direct"),
    pytest.param(4, 1, 32, 16, [5, 270, 33], 0, 3, torch.float32, torch.float32, id="fp32-3splits-gqa4"),
    pytest.param(2, 2, 64, 8, [40, 17], 0, 8, torch.bfloat16, torch.bfloat16, id="bf16-more-splits-than-tiles"),
    pytest.param(6, 1, 16, 4, [20, 7], 9, 2, torch.float16, torch.float16, id="fp16-gqa6-window"),
    pytest.param(1, 3, 16, 4, [12, 3], 0, 2, torch.bfloat16, torch.bfloat16, id="mha-bf16"),
    pytest.param(2, 2, 24, 4, [12, 30], 0, 2, torch.float32, torch.float32, id="head-dim-24-two-launches"),
    # The 8B model's heads, pipelined 128-key tiles: the new key is read back in the last one.
    pytest.param(4, 2, 128, 16, [1000, 77, 129], 0, 4, torch.bfloat16, torch.bfloat16, id="bf16-d128-long"),
]


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size,seq_lens,window,num_splits,dtype,cache_dtype",
                         FUSED_ROPE_CASES)
def test_decode_with_rope_equals_rope_write_kv_then_decode(group: int, kv_heads: int, head_dim: int,
                                                           block_size: int, seq_lens: list[int], window: int,
                                                           num_splits: int, dtype: torch.dtype,
                                                           cache_dtype: torch.dtype) -> None:
    """One launch that rotates q and writes the new key and value before attending gives the
    same bits in both caches as `rope_write_kv` followed by a plain decode, and the same output
    to its dtype's last bit: on a GPU the two launches are different programs (FMA contraction,
    dot layouts), and the H100 rounds some outputs one bit apart (exact through the interpreter).
    A padding row (slot < 0, length 1) writes nothing and its output is left to the padding."""
    gen = torch.Generator().manual_seed(head_dim + 3 * sum(seq_lens) + num_splits)
    heads, batch = group * kv_heads, len(seq_lens) + 1  # the last row pads a graph bucket
    lens_list = seq_lens + [1]
    tables, num_blocks = make_block_tables(lens_list, block_size, gen)
    key_cache, value_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, gen)
    max_pos = max(lens_list) + 8
    cos = torch.randn(max_pos, head_dim, generator=gen).to(dtype).to(DEVICE)  # halves differ: both are read
    sin = torch.randn(max_pos, head_dim, generator=gen).to(dtype).to(DEVICE)
    qkv = (torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype).to(DEVICE)
    positions = torch.tensor([n - 1 for n in lens_list], dtype=torch.int32, device=DEVICE)
    last = [tables[b, (n - 1) // block_size].item() * block_size + (n - 1) % block_size
            for b, n in enumerate(seq_lens)]
    slots = torch.tensor(last + [-1], dtype=torch.int64, device=DEVICE)
    lens = torch.tensor(lens_list, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(batch, heads, head_dim), k.view(batch, kv_heads, head_dim), v.view(batch, kv_heads, head_dim)

    ref_q, ref_k, ref_v = views(qkv.clone())
    ref_kc, ref_vc = key_cache.clone(), value_cache.clone()
    ref_out = torch.full_like(ref_q, SENTINEL)
    rope_write_kv(ref_q, ref_k, ref_v, cos, sin, positions, ref_kc, ref_vc, slots)
    decode_attention(ref_q, ref_kc, ref_vc, tables, lens, block_size, scale, window, ref_out, num_splits)

    q, k, v = views(qkv.clone())
    out = torch.full_like(q, SENTINEL)
    decode_attention(q, key_cache, value_cache, tables, lens, block_size, scale, window, out, num_splits,
                     DecodeRope(k, v, cos, sin, positions, slots))

    real = len(seq_lens)
    assert torch.equal(key_cache, ref_kc) and torch.equal(value_cache, ref_vc)
    # The H100 measured up to 1 bf16 bit (0.002 at 0.25-0.5) and 1.7e-6 in float32.
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out[:real], ref_out[:real], rtol=rtol, atol=1e-5)
    if DEVICE == "cpu":
        assert torch.equal(out[:real], ref_out[:real])
    assert not torch.equal(ref_kc[slots[:real]], ref_k[:real].to(cache_dtype))  # the cache's new keys are rotated
    if rope_fuses(head_dim):  # one launch: q itself is left as it was
        assert torch.equal(q, views(qkv)[0])


def test_a_cache_in_another_dtype_than_the_query_is_refused() -> None:
    """A GPU build of the attention kernels rejects tl.dot on two dtypes (the interpreter does
    not), so the wrappers refuse such a cache before launching."""
    gen = torch.Generator().manual_seed(1)
    tables, num_blocks = make_block_tables([5], 4, gen)
    key_cache, value_cache = make_cache(num_blocks, 4, 2, 16, torch.float32, gen)
    query = torch.zeros(1, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="cache dtype torch.float32 is not the query's torch.bfloat16"):
        decode_attention(query, key_cache, value_cache, tables, lens, 4, 0.25, 0, torch.empty_like(query), 1)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="cache dtype torch.float32 is not the query's torch.bfloat16"):
        prefill_attention(query, key_cache, value_cache, tables, lens, starts, 1, 4, 0.25, 0, torch.empty_like(query))


def test_decode_splits_agree_with_one_split() -> None:
    """Cutting rows into 1, 3 or 8 splits (more than the longest row's 4 key tiles) agrees."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, block_size, kv_heads, group, head_dim = [50, 400, 2], 16, 2, 2, 16
    tables, num_blocks = make_block_tables(seq_lens, block_size, gen)
    key_cache, value_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32, gen)
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    outs = []
    for splits in (1, 3, 8):
        out = torch.empty_like(query)
        decode_attention(query, key_cache, value_cache, tables, lens, block_size, 0.25, 0, out, splits)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- prefill

PREFILL_CASES = [
    # (group, kv_heads, head_dim, block_size, seq_lens, q_lens, window, dtype)
    pytest.param(1, 2, 16, 4, [5, 17, 1], [5, 17, 1], 0, torch.float32, id="fresh-mha-bs4"),
    pytest.param(2, 2, 16, 16, [20, 33], [6, 17], 0, torch.float32, id="chunked-gqa2-bs16"),
    pytest.param(4, 1, 24, 16, [9, 1, 40, 17], [1, 1, 23, 1], 0, torch.float32, id="mixed-gqa4-kv1"),
    pytest.param(2, 2, 16, 1, [12, 7], [12, 3], 5, torch.float32, id="window-smaller-bs1"),
    pytest.param(1, 1, 16, 4, [16, 10], [8, 10], 64, torch.float32, id="window-larger"),
    pytest.param(2, 1, 16, 16, [150], [150], 0, torch.float32, id="fresh-long-unmasked-tiles"),
    pytest.param(1, 2, 16, 8, [200, 90], [10, 90], 100, torch.float32, id="chunked-long-window"),
    pytest.param(2, 2, 32, 16, [160, 20], [100, 4], 0, torch.bfloat16, id="bf16-chunked-long"),
    pytest.param(4, 2, 16, 4, [30, 13], [30, 5], 9, torch.float16, id="fp16-window-chunked"),
]


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size,seq_lens,q_lens,window,dtype", PREFILL_CASES)
def test_prefill_matches_reference(group: int, kv_heads: int, head_dim: int, block_size: int,
                                   seq_lens: list[int], q_lens: list[int], window: int,
                                   dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + 7 * sum(q_lens) + block_size)
    heads = group * kv_heads
    tables, num_blocks = make_block_tables(seq_lens, block_size, gen)
    key_cache, value_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    total = sum(q_lens)
    # Two trailing padding tokens (a CUDA-graph-sized step): not covered by query_start_loc.
    query = torch.randn(total + 2, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(query, SENTINEL)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    prefill_attention(query, key_cache, value_cache, tables, lens, starts, max(q_lens), block_size,
                      scale, window, out)

    assert out.shape == (total + 2, heads, head_dim) and out.dtype == dtype
    assert bool((out[total:] == SENTINEL).all())
    tol = TOL[dtype]
    begin = 0
    for s, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        k = gather(key_cache, tables[s], n, block_size)
        v = gather(value_cache, tables[s], n, block_size)
        q_pos = list(range(n - q_len, n))
        ref = ref_attention(query[begin:begin + q_len], k, v, q_pos, scale, window)
        torch.testing.assert_close(out[begin:begin + q_len].double(), ref, rtol=tol, atol=tol)
        begin += q_len


def test_prefill_one_token_rows_match_decode() -> None:
    """A 1-token prefill row and a decode row over the same cache agree."""
    gen = torch.Generator().manual_seed(11)
    seq_lens, block_size, kv_heads, group, head_dim = [13, 40], 4, 2, 2, 16
    tables, num_blocks = make_block_tables(seq_lens, block_size, gen)
    key_cache, value_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32, gen)
    query = torch.randn(2, kv_heads * group, head_dim, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    out_p, out_d = torch.empty_like(query), torch.empty_like(query)
    prefill_attention(query, key_cache, value_cache, tables, lens, starts, 1, block_size, 0.3, 0, out_p)
    decode_attention(query, key_cache, value_cache, tables, lens, block_size, 0.3, 0, out_d, 2)
    torch.testing.assert_close(out_p, out_d, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- heuristics

def test_default_num_splits() -> None:
    # Few rows, long context: up to 32 splits to fill ~2 waves of 132 SMs.
    assert default_num_splits(1, 8, 32768, 16, 132) == 32
    # Many rows already fill the GPU: one split.
    assert default_num_splits(256, 8, 4096, 16, 132) == 1
    # Short context: no split shorter than ~256 keys.
    assert default_num_splits(1, 8, 600, 16, 132) == 3
    assert default_num_splits(4, 2, 1, 16, 132) == 1
    assert default_num_splits(2, 4, 4096, 16, 132) == 16  # ceil(264 / 8) = 33 -> capped by length
