"""Tests for tandem.workers.model.attention: paged attention against a dense reference."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels import cpu_kernels
from tandem.workers.model import attention
from tandem.workers.model.attention import AttentionMetadata, PrefillSeq, paged_attention, plan_decode_groups

BS, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
SCALE = HEAD_DIM ** -0.5
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def torch_path(monkeypatch) -> None:
    """The torch path (whose decode groups some tests inspect), whatever an earlier model
    load in this process switched on."""
    monkeypatch.setattr(cpu_kernels, "ACTIVE", None)


@pytest.fixture(params=["torch", "kernel"])
def decode_path(request, monkeypatch) -> str:
    """The torch path, and again the compiled CPU kernel."""
    if request.param == "kernel":
        from tandem.workers.kernels.cpu_kernels import compiled_kernels

        kernel = compiled_kernels()
        assert kernel is not None, "the CPU kernel did not build (see the log)"
        monkeypatch.setattr(cpu_kernels, "ACTIVE", kernel)
    return request.param


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int],
                    window: int | None) -> torch.Tensor:
    """q: [q_len, heads, hd]; k/v: a sequence's whole [ctx_len, kv_heads, hd]. Float64, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    k_pos = torch.arange(k.shape[0])[None, :]
    qp = torch.tensor(q_pos)[:, None]
    visible = k_pos <= qp
    if window is not None:
        visible &= k_pos > qp - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_step(decode_lens: list[int], prefill: tuple[int, int] | None, window: int | None,
             device: torch.device = CPU, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step of decodes (context lengths decode_lens) and optionally a prefill chunk
    (prefix, chunk) over scattered blocks; returns paged output, dense reference, metadata."""
    g = torch.Generator().manual_seed(seed)
    ctx_lens = decode_lens + ([sum(prefill)] if prefill else [])
    q_lens = [1] * len(decode_lens) + ([prefill[1]] if prefill else [])
    num_blocks = sum(-(-n // BS) for n in ctx_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    key_cache = torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM, generator=g)  # garbage where unwritten
    value_cache = torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM, generator=g)
    tables, full_k, full_v, slots = [], [], [], []
    for n, q_len in zip(ctx_lens, q_lens):
        table = [perm.pop() for _ in range(-(-n // BS))]
        seq_slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
        key_cache[seq_slots[:n - q_len]] = k[:n - q_len]  # the cached prefix
        value_cache[seq_slots[:n - q_len]] = v[:n - q_len]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
        slots.append(seq_slots[n - q_len:])
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=g)
    key = torch.cat([k[n - q:] for k, n, q in zip(full_k, ctx_lens, q_lens)])
    value = torch.cat([v[n - q:] for v, n, q in zip(full_v, ctx_lens, q_lens)])
    prefills = []
    if prefill:
        prefills.append(PrefillSeq(len(decode_lens), prefill[1], sum(prefill), list(tables[-1])))
    d = len(decode_lens)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(device), num_decodes=d,
                             decode_block_tables=tables[:d] or None, decode_seq_lens=decode_lens or None,
                             prefills=prefills, block_size=BS)
    refs, start = [], 0
    for k, v, n, q_len in zip(full_k, full_v, ctx_lens, q_lens):
        refs.append(dense_attention(query[start:start + q_len], k, v, list(range(n - q_len, n)), window))
        start += q_len
    query, key, value, key_cache, value_cache = (t.to(device) for t in (query, key, value, key_cache, value_cache))
    out = paged_attention(query, key, value, key_cache, value_cache, meta, SCALE, window).cpu()
    return out, torch.cat(refs).reshape(out.shape), meta


MIXED = [1, 3, 4, 5, 9, 17, 30, 31, 64, 7]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group_bytes", [1, 1 << 30])  # one row per group / lengths alone decide
def test_decodes_and_prefill_match_dense(window: int | None, group_bytes: int, decode_path: str,
                                        monkeypatch) -> None:
    monkeypatch.setitem(attention.GROUP_BYTES, "cpu", group_bytes)
    out, ref, meta = run_step(MIXED, prefill=(10, 5), window=window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if decode_path == "kernel":
        assert meta.decode_groups_by_window == {}  # no groups planned: the kernel reads the blocks in place
        return
    groups = meta.decode_groups_by_window[window]
    assert sorted(r for grp in groups for r in grp.rows.tolist()) == list(range(len(MIXED)))
    if group_bytes == 1:
        assert [grp.num_rows for grp in groups] == [1] * len(MIXED)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 6])
def test_matches_dense_on_cuda(window: int | None) -> None:
    out, ref, _ = run_step(MIXED, prefill=(10, 5), window=window, device=torch.device("cuda"))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_equal_lengths_form_one_unmasked_group() -> None:
    out, ref, meta = run_step([12] * 5, prefill=None, window=None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    [group] = meta.decode_groups_by_window[None]
    assert (group.num_rows, group.num_keys, group.mask) == (5, 12, None)


def test_plan_groups_by_length_and_budget() -> None:
    lens = [40, 8, 33, 5, 17, 36]
    tables = [list(range(100 * r, 100 * r + -(-n // BS))) for r, n in enumerate(lens)]
    # Blocks needed: 10, 2, 9, 2, 5, 9. Longest first; 5 blocks is padded to 10 (kept),
    # then 2 would be padded to more than twice its own (new group).
    groups = plan_decode_groups(tables, lens, BS, None, max_group_blocks=1000, device=CPU)
    assert [g.rows.tolist() for g in groups] == [[0, 2, 5, 4], [1, 3]]
    assert [g.num_keys for g in groups] == [40, 8]
    assert groups[0].block_ids.tolist()[:10] == tables[0]
    assert groups[0].block_ids.tolist()[30:] == tables[4] + [0] * 5  # padded with block 0
    assert groups[1].mask[:, 0, 0].tolist() == [[True] * 8, [True] * 5 + [False] * 3]
    # A budget of 20 blocks fits two rows of the longest.
    groups = plan_decode_groups(tables, lens, BS, None, max_group_blocks=20, device=CPU)
    assert [g.rows.tolist() for g in groups] == [[0, 2], [5, 4], [1, 3]]


def test_plan_skips_blocks_before_window() -> None:
    lens, window = [30, 9], 6
    tables = [list(range(8)), [20, 21, 22]]
    [group] = plan_decode_groups(tables, lens, BS, window, max_group_blocks=1000, device=CPU)
    # Row 0 sees positions 24..29 (blocks 6, 7); row 1 sees 3..8 (blocks 0..2).
    assert group.rows.tolist() == [1, 0]
    assert group.block_ids.tolist() == [20, 21, 22, 6, 7, 0]
    assert group.num_keys == 9
    assert group.mask[:, 0, 0].tolist() == [[False] * 3 + [True] * 6, [True] * 6 + [False] * 3]


def test_groups_are_planned_once_per_step() -> None:
    _, _, meta = run_step([5, 20], prefill=None, window=None)
    groups = meta.decode_groups_by_window[None]
    assert meta.decode_groups(None, 1000, CPU) is groups


@pytest.mark.parametrize("prefill", [(0, 12), (10, 5)])  # a fresh prompt; a chunk over a cached prefix
def test_prefill_attention_takes_the_flash_kernel_on_cpu(prefill) -> None:
    """3-D inputs sent SDPA to its math path (4x slower at 300 tokens): prefill passes 4-D ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, ref, _ = run_step([], prefill=prefill, window=None)
    names = {event.key for event in prof.key_averages()}
    assert any("flash_attention" in name for name in names), sorted(n for n in names if "attention" in n)
    assert not any("attention_math" in name for name in names)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
