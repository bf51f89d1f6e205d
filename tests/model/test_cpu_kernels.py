"""The compiled CPU paged-decode kernel against the torch path it replaces: the same
attention (to float32 rounding) for plain and grouped-query heads, a sliding window,
lengths of one token and of whole blocks, one row (heads split over threads) and many, and
head sizes it unrolls (64, 128) or loops over (16). And it really runs on every thread."""

from __future__ import annotations

import pytest
import torch

from tandem.workers import attention
from tandem.workers.attention import AttentionMetadata, decode_attention
from tandem.workers.cpu_kernels import paged_decode_kernel


@pytest.fixture(scope="module")
def kernel():
    module = paged_decode_kernel()
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


@pytest.mark.parametrize(("num_heads", "kv_heads", "lens", "window", "head_dim"), [
    (4, 4, [1, 4, 5, 17, 40], None, 16),      # one token, a whole block, partial blocks
    (8, 2, [9, 33, 12], None, 16),            # grouped-query heads
    (4, 1, [30, 7, 16], 8, 16),               # a sliding window shorter and longer than rows
    (4, 2, [57], None, 16),                   # one row: its KV heads split over the threads
    (8, 2, [1, 23, 64, 9], 12, 64),           # the unrolled head sizes
    (2, 2, [3, 40], None, 128),
])
def test_kernel_equals_the_torch_path(kernel, monkeypatch, num_heads, kv_heads, lens, window, head_dim) -> None:
    query, key_cache, value_cache, meta = _case(num_heads, kv_heads, lens, head_dim=head_dim)
    monkeypatch.setattr(attention, "PAGED_DECODE_KERNEL", None)
    expected = torch.zeros_like(query)
    decode_attention(query, key_cache, value_cache, meta, 0.25, window, expected)
    monkeypatch.setattr(attention, "PAGED_DECODE_KERNEL", kernel)
    got = torch.zeros_like(query)
    decode_attention(query, key_cache, value_cache, meta, 0.25, window, got)
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
    assert attention.PAGED_DECODE_KERNEL is kernel
