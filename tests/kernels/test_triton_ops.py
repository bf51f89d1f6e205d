"""Fused Triton row/elementwise ops (RMSNorm, fused add+RMSNorm, RoPE, SiLU-and-mul) against the
transformers formulas, written here exactly as transformers computes them.

Runs on CUDA when present, else through Triton's interpreter on CPU (TRITON_INTERPRET=1 must be
set before triton is imported, hence the environment line above the imports). Sizes are tiny:
the interpreter executes every program instance in Python.

Tolerances are in units in the last place (ulps) of the dtype: the kernels compute in float32
and round once, where the torch formulas round some intermediates to bf16/fp16, so 16-bit
results may differ by an ulp or two; float32 results agree to a few float32 ulps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tandem.workers.kernels.triton_attention import write_kv  # noqa: E402
from tandem.workers.kernels.triton_ops import (  # noqa: E402
    copy_pending,
    fused_add_rms_norm,
    rms_norm,
    rope_,
    rope_write_kv,
    silu_and_mul,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAX_ULPS = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# ----------------------------------------------------------------------------- helpers

def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |magnitude| (float64), floored at the smallest normal."""
    info = torch.finfo(dtype)
    a = magnitude.double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(a))) * info.eps


def assert_ulps(out: torch.Tensor, ref: torch.Tensor, max_ulps: float, scale: torch.Tensor | None = None) -> None:
    """|out - ref| <= max_ulps ulps of `scale` (default: the larger of |out|, |ref|)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.double().cpu(), ref.double().cpu()
    if scale is None:
        scale = torch.maximum(o.abs(), r.abs())
    err = (o - r).abs() / ulp(scale.cpu(), out.dtype)
    assert torch.isfinite(o).all()
    assert err.max().item() <= max_ulps, f"max error {err.max().item():.2f} ulps > {max_ulps}"


def assert_mostly_bit_exact(out: torch.Tensor, ref: torch.Tensor) -> None:
    """16-bit RMSNorm must reproduce the reference's rounding steps, not just land near it: only a
    float32 reduction-order difference that straddles a rounding boundary may flip a bit (rare).
    Skipping the rounding of y before the weight makes ~25% of elements differ."""
    if out.dtype != torch.float32:
        assert (out == ref).float().mean().item() >= 0.99


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEVICE)


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    dtype = x.dtype
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(max_pos: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_pos, head_dim] as HF builds them: the half-dim frequencies duplicated."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 96), (1, 256), (13, 192), (40, 96)])
def test_rms_norm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    # Rows of very different magnitude: the normalisation, not the input scale, sets the output.
    x = randn(rows, hidden, dtype=dtype, gen=gen) * torch.logspace(-2, 2, rows).to(dtype).to(DEVICE)[:, None]
    w = randn(hidden, dtype=dtype, gen=gen, scale=0.5) + 1
    x_before = x.clone()
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape and out.data_ptr() != x.data_ptr()
    assert torch.equal(x, x_before)
    ref = ref_rms_norm(x, w, 1e-6)
    assert_ulps(out, ref, MAX_ULPS[dtype])
    assert_mostly_bit_exact(out, ref)


def test_rms_norm_strided_rows_and_empty() -> None:
    gen = torch.Generator().manual_seed(7)
    big = randn(5, 160, dtype=torch.bfloat16, gen=gen)
    x = big[:, 16:112]  # [5, 96] rows with stride 160
    w = randn(96, dtype=torch.bfloat16, gen=gen) + 1
    assert_ulps(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), 2)
    assert rms_norm(big[:0, :96], w, 1e-5).shape == (0, 96)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 192), (17, 96), (6, 128)])
def test_fused_add_rms_norm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + hidden)
    x = randn(rows, hidden, dtype=dtype, gen=gen)
    residual = randn(rows, hidden, dtype=dtype, gen=gen, scale=4.0)
    w = randn(hidden, dtype=dtype, gen=gen, scale=0.5) + 1
    new_residual = x + residual  # torch rounds the sum to the dtype
    expected = ref_rms_norm(new_residual, w, 1e-5)
    fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, new_residual)  # bit-exact
    assert_ulps(x, expected, MAX_ULPS[dtype])
    assert_mostly_bit_exact(x, expected)


# ----------------------------------------------------------------------------- RoPE

def rope_case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, pos_dtype: torch.dtype,
              random_tables: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_pos = 64
    if random_tables:  # halves not duplicated: the kernel must read both halves of each row
        cos = randn(max_pos, head_dim, dtype=dtype, gen=gen)
        sin = randn(max_pos, head_dim, dtype=dtype, gen=gen)
    else:
        cos, sin = rope_tables(max_pos, head_dim, dtype)
    # One fused qkv output; q and k are strided views into it (row stride (H + 2 KV) * D).
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen, scale=3.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    assert tokens == 1 or not (q.is_contiguous() or k.is_contiguous())
    pos = torch.randint(0, max_pos, (tokens,), generator=gen).to(pos_dtype).to(DEVICE)
    before = qkv.clone()
    c, s = cos[pos][:, None], sin[pos][:, None]
    q_ref, k_ref = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s  # HF apply_rotary_pos_emb
    # Ground truth in float64 from the same (rounded) operands: a kernel that rounds once is
    # within half an ulp of it, plus float32 slack.
    q64, k64, c64, s64 = q.double(), k.double(), c.double(), s.double()
    q_true, k_true = q64 * c64 + rotate_half(q64) * s64, k64 * c64 + rotate_half(k64) * s64
    q_scale = q64.abs() * c64.abs() + rotate_half(q64).abs() * s64.abs()
    k_scale = k64.abs() * c64.abs() + rotate_half(k64).abs() * s64.abs()

    rope_(q, k, cos, sin, pos)

    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched
    n = MAX_ULPS[dtype]
    assert_ulps(q, q_ref, n, q_scale)
    assert_ulps(k, k_ref, n, k_scale)
    for out, true, scale in ((q, q_true, q_scale), (k, k_true, k_scale)):
        err = (out.double() - true).abs().cpu()
        bound = 0.5 * ulp(true.cpu(), dtype) * 1.001 + scale.cpu() * 2.0**-20
        assert (err <= bound).all(), "not rounded once"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_gqa_fused_qkv(dtype: torch.dtype, head_dim: int, pos_dtype: torch.dtype) -> None:
    rope_case(7, heads=4, kv_heads=2, head_dim=head_dim, dtype=dtype, pos_dtype=pos_dtype,
              random_tables=False, seed=head_dim)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,random_tables", [
    (1, 6, 1, 64, False),   # one decode row, GQA 6:1, non-power-of-two head count
    (5, 3, 3, 16, True),    # MHA, tables whose halves differ
    (3, 2, 1, 96, False),   # head_dim 96: half 48 is not a power of two
])
def test_rope_shapes(tokens: int, heads: int, kv_heads: int, head_dim: int, random_tables: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        rope_case(tokens, heads, kv_heads, head_dim, dtype, torch.int64, random_tables, seed=tokens + heads)


def test_rope_contiguous_q_k() -> None:
    gen = torch.Generator().manual_seed(3)
    cos, sin = rope_tables(32, 16, torch.float16)
    q = randn(4, 4, 16, dtype=torch.float16, gen=gen)
    k = randn(4, 1, 16, dtype=torch.float16, gen=gen)
    pos = torch.tensor([0, 31, 5, 5], dtype=torch.int32, device=DEVICE)
    c, s = cos[pos][:, None], sin[pos][:, None]
    q_ref, k_ref = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    rope_(q, k, cos, sin, pos)
    scale_q = (q_ref.abs().double() + 1e-3)
    assert_ulps(q, q_ref, 2, torch.maximum(scale_q, q.abs().double()))
    assert_ulps(k, k_ref, 2, torch.maximum(k_ref.abs().double() + 1e-3, k.abs().double()))
    assert torch.equal(q[0], q_ref[0])  # position 0: cos 1, sin 0 -> identity


@pytest.mark.parametrize("dtype,cache_dtype,index_dtype,heads,kv_heads,head_dim", [
    (torch.float32, torch.float32, torch.int64, 4, 2, 16),
    (torch.bfloat16, torch.bfloat16, torch.int32, 6, 1, 64),   # GQA 6:1, one decode-like KV head
    (torch.float16, torch.float16, torch.int32, 3, 3, 96),     # MHA; half 48 is not a power of two
    (torch.bfloat16, torch.float32, torch.int32, 4, 2, 16),    # a cache wider than the model dtype
])
def test_rope_write_kv_equals_rope_then_write_kv(dtype: torch.dtype, cache_dtype: torch.dtype,
                                                 index_dtype: torch.dtype, heads: int, kv_heads: int,
                                                 head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    tokens, num_slots, max_pos = 6, 24, 64
    cos = randn(max_pos, head_dim, dtype=dtype, gen=gen)  # halves differ: both are read
    sin = randn(max_pos, head_dim, dtype=dtype, gen=gen)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen, scale=3.0)
    before = qkv.clone()
    pos = torch.randint(0, max_pos, (tokens,), generator=gen).to(index_dtype).to(DEVICE)
    slots = torch.tensor([13, -1, 0, 23, -7, 4], dtype=index_dtype, device=DEVICE)  # < 0: padding rows

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        key_cache = torch.full((num_slots, kv_heads, head_dim), 7.0, dtype=cache_dtype, device=DEVICE)
        return key_cache, key_cache.clone()

    ref_qkv = qkv.clone()
    ref_q, ref_k, ref_v = views(ref_qkv)
    ref_kc, ref_vc = caches()
    rope_(ref_q, ref_k, cos, sin, pos)
    write_kv(ref_k, ref_v, ref_kc, ref_vc, slots)

    q, k, v = views(qkv)
    key_cache, value_cache = caches()
    rope_write_kv(q, k, v, cos, sin, pos, key_cache, value_cache, slots)

    assert torch.equal(q, ref_q)  # the same bits as RoPE alone
    assert torch.equal(key_cache, ref_kc) and torch.equal(value_cache, ref_vc)  # padding slots untouched
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])  # k and v left as they were
    written = slots.long() >= 0
    assert not torch.equal(key_cache[slots.long()[written]], k[written].to(cache_dtype))  # the cache's k is rotated


def test_rope_write_kv_empty_step() -> None:
    cos, sin = rope_tables(8, 16, torch.float32)
    q, k = torch.zeros(0, 2, 16, device=DEVICE), torch.zeros(0, 1, 16, device=DEVICE)
    cache = torch.zeros(4, 1, 16, device=DEVICE)
    index = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    rope_write_kv(q, k, k, cos, sin, index, cache, cache.clone(), index)
    assert bool((cache == 0).all())


# ----------------------------------------------------------------------------- SiLU and mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 96), (9, 192), (2, 2500)])  # 2500: three 1024-column blocks
def test_silu_and_mul(dtype: torch.dtype, rows: int, d: int) -> None:
    gen = torch.Generator().manual_seed(rows + d)
    gate_up = randn(rows, 2 * d, dtype=dtype, gen=gen, scale=3.0)
    gate, up = gate_up[:, :d], gate_up[:, d:]
    ref = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == (rows, d) and out.dtype == dtype and out.is_contiguous()
    assert_ulps(out, ref, MAX_ULPS[dtype])
    g, u = gate.double(), up.double()
    true = g / (1 + torch.exp(-g)) * u
    err = (out.double() - true).abs().cpu()
    assert (err <= 0.5 * ulp(true.cpu(), dtype) * 1.001 + true.abs().cpu() * 2.0**-20).all(), "not rounded once"


def test_silu_and_mul_empty() -> None:
    assert silu_and_mul(torch.zeros(0, 64, device=DEVICE)).shape == (0, 32)


# ----------------------------------------------------------------------------- CUDA graphs

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_ops_capture_in_cuda_graph() -> None:
    gen = torch.Generator().manual_seed(11)
    dtype, T, H, KV, D, hidden, d = torch.bfloat16, 8, 8, 2, 64, 512, 704
    x, res = randn(T, hidden, dtype=dtype, gen=gen), randn(T, hidden, dtype=dtype, gen=gen)
    w = randn(hidden, dtype=dtype, gen=gen) + 1
    qkv = randn(T, (H + 2 * KV) * D, dtype=dtype, gen=gen)
    gate_up = randn(T, 2 * d, dtype=dtype, gen=gen)
    cos, sin = rope_tables(128, D, dtype)
    pos = torch.arange(T, device=DEVICE)
    q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D: (H + KV) * D].view(T, KV, D)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        fused_add_rms_norm(x, res, w, 1e-5)
        rope_(q, k, cos, sin, pos)
        return rms_norm(x, w, 1e-5), silu_and_mul(gate_up)

    inputs = [t.clone() for t in (x, res, qkv)]
    step()  # compile outside the capture
    for t, v in zip((x, res, qkv), inputs):
        t.copy_(v)
    eager = [t.clone() for t in step()] + [x.clone(), res.clone(), qkv.clone()]
    for t, v in zip((x, res, qkv), inputs):
        t.copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t, v in zip((x, res, qkv), inputs):
        t.copy_(v)
    pos.add_(0)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(list(outs) + [x, res, qkv], eager):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- tokens scheduled ahead

@pytest.mark.parametrize("token_dtype", [torch.int64, torch.int32])
def test_copy_pending_puts_each_sampled_token_where_it_is_pending(token_dtype: torch.dtype) -> None:
    # 200 pending rows (two loop iterations of 128) of a 300-token step, scattered both ways;
    # index views at odd offsets of a packed int32 buffer, as a step's are.
    gen = torch.Generator().manual_seed(3)
    ids = torch.full((300,), -5, dtype=torch.int32, device=DEVICE)
    tokens = torch.randint(0, 30000, (250,), generator=gen).to(token_dtype).to(DEVICE)
    dst = torch.randperm(300, generator=gen)[:200].to(torch.int32)
    src = torch.randint(0, 250, (200,), generator=gen).to(torch.int32)
    packed = torch.cat([torch.tensor([7], dtype=torch.int32), dst, src]).to(DEVICE)
    copy_pending(ids, packed[1:201], packed[201:], tokens)
    expected = torch.full((300,), -5, dtype=torch.int32)
    expected[dst.long()] = tokens.cpu()[src.long()].to(torch.int32)
    assert torch.equal(ids.cpu(), expected)
    copy_pending(ids, packed[:0], packed[:0], tokens)  # nothing pending: nothing launched
    assert torch.equal(ids.cpu(), expected)
