"""The compiled CPU paged-decode kernel against the torch path it replaces: the same
attention (to float32 rounding) for plain and grouped-query heads, a sliding window,
lengths of one token and of whole blocks, one row (heads split over threads) and many, and
head sizes it unrolls (64, 128) or loops over (16). And it really runs on every thread."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels import cpu_kernels
from tandem.workers.kernels.cpu_kernels import compiled_kernels
from tandem.workers.model.attention import AttentionMetadata, decode_attention


@pytest.fixture(scope="module")
def kernel():
    module = compiled_kernels()
    assert module is not None, "the CPU kernel did not build (see the log): a compiler is expected here"
    return module


def _case(num_heads: int, kv_heads: int, lens: list[int], block_size: int = 4, head_dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered, as after churn
    tables, used = [], 0
    for n in lens:
        tables.append(order[used:used + -(-n // block_size)])
        used += len(tables[-1])
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), num_decodes=len(lens),
                             decode_block_tables=tables, decode_seq_lens=lens, block_size=block_size)
    return query, key_cache, value_cache, meta


def _decode(monkeypatch, active, query, key_cache, value_cache, meta, scale, window) -> torch.Tensor:
    """decode_attention with the kernels `active` (None: the torch path)."""
    monkeypatch.setattr(cpu_kernels, "ACTIVE", active)
    out = torch.zeros(query.shape)
    decode_attention(query, key_cache, value_cache, meta, scale, window, out)
    return out


@pytest.mark.parametrize(("num_heads", "kv_heads", "lens", "window", "head_dim"), [
    (4, 4, [1, 4, 5, 17, 40], None, 16),      # one token, a whole block, partial blocks
    (8, 2, [9, 33, 12], None, 16),            # grouped-query heads
    (4, 1, [30, 7, 16], 8, 16),               # a sliding window shorter and longer than rows
    (4, 2, [57], None, 16),                   # one row: its KV heads split over the threads
    (8, 2, [1, 23, 64, 9], 12, 64),           # the unrolled head sizes
    (2, 2, [3, 40], None, 128),
])
def test_kernel_equals_the_torch_path(kernel, monkeypatch, num_heads, kv_heads, lens, window, head_dim) -> None:
    case = _case(num_heads, kv_heads, lens, head_dim=head_dim)
    expected = _decode(monkeypatch, None, *case, 0.25, window)
    got = _decode(monkeypatch, kernel, *case, 0.25, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_query_rows_may_be_strided(kernel, monkeypatch) -> None:
    """The query arrives as a view of the fused qkv output (RoPE rotates it in place)."""
    query, *cache = _case(8, 2, [9, 33, 12], head_dim=64)
    qkv = torch.cat([query.flatten(1), torch.randn(3, 2 * 2 * 64)], dim=1)
    strided = qkv[:, :8 * 64].view(3, 8, 64)
    assert not strided.is_contiguous()
    expected = _decode(monkeypatch, None, query, *cache, 0.125, None)
    got = _decode(monkeypatch, kernel, strided, *cache, 0.125, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_it_runs_on_every_thread(kernel) -> None:
    # Built without OpenMP, at::parallel_for would quietly run everything on one thread. The
    # one-thread build is for compilers without OpenMP; gcc on Linux has it.
    assert not kernel.__name__.endswith("_serial")
    assert kernel.parallel_threads() == torch.get_num_threads()


def test_the_engine_uses_it_on_cpu_float32(kernel) -> None:
    from tandem.workers.llm import LLM
    from tests.conftest import tiny_model

    LLM(tiny_model("llama"))
    assert cpu_kernels.ACTIVE is kernel


# ---- the row kernels (csrc/rows.cpp) against the torch ops they replace ----------------------

def test_argmax_rows_equals_torch(kernel) -> None:
    x = torch.randn(7, 1000, generator=torch.Generator().manual_seed(1))
    x[1, 10] = x[1, 500] = x[1].max() + 1  # a tie: the lower id wins
    x[2] = float("-inf")                   # every token masked
    x[3, 700] = x[3, 900] = float("nan")   # NaN wins, the first one
    x[4, 0] = float("inf")
    x[5, 999] = x[5].max() + 1             # the last id
    assert kernel.argmax_rows(x).tolist() == x.argmax(-1).tolist()
    assert kernel.argmax_rows(x[:0]).tolist() == []


def test_rope_equals_the_torch_path_to_the_bit(kernel, monkeypatch) -> None:
    from tandem.workers.model.layers import RotaryEmbedding, rope_inv_freq

    inv_freq, scaling = rope_inv_freq(64, 10000.0, None)
    rope = RotaryEmbedding(64, 512, inv_freq, scaling, torch.float32)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(37, (8 + 2 * 2) * 64, generator=gen) * 3
    positions = torch.randint(0, 512, (37,), generator=gen)

    def run(active):
        monkeypatch.setattr(cpu_kernels, "ACTIVE", active)
        q, k, _ = qkv.clone().split([8 * 64, 2 * 64, 2 * 64], dim=-1)
        q, k = rope(positions, q.view(-1, 8, 64), k.view(-1, 2, 64))
        return q.clone(), k.clone()

    (q0, k0), (q1, k1) = run(None), run(kernel)
    assert torch.equal(q0, q1) and torch.equal(k0, k1)


def test_rms_norm_equals_the_torch_path(kernel, monkeypatch) -> None:
    from tandem.workers.model.layers import RMSNorm

    norm = RMSNorm(512, 1e-6, torch.float32)
    norm.weight.data = torch.rand(512, generator=torch.Generator().manual_seed(3)) + 0.5
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(4)) * 5
    monkeypatch.setattr(cpu_kernels, "ACTIVE", None)
    expected = norm(x)
    monkeypatch.setattr(cpu_kernels, "ACTIVE", kernel)
    torch.testing.assert_close(norm(x), expected, rtol=4e-7, atol=0)  # a last-bit mean: ~2 ulps
