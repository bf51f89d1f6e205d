"""Attention over a paged KV cache (torch reference path).

Cache layout per layer: key and value tensors of shape
    [num_blocks * block_size, num_kv_heads, head_dim]
A token at position p of a sequence lives in slot block_table[p // bs] * bs + p % bs.

A step's tokens are ordered decodes first (one token each), then prefill chunks (several
tokens each; a chunk attends to its cached prefix plus itself, causally).

Decodes are attended in groups of similar length. A group's blocks are gathered into one
padded batch, one contiguous copy per block, for one SDPA call:

    rows sorted by blocks needed:  |########|  |######  |  ...  |###|  |##|
                                   '--- group 0 -------'        '- group k -'

Grouping keeps padding small when lengths differ, bounds the gathered copy's memory, and
on CPU keeps the copy small enough to still be in cache when SDPA reads it, so K and V
come from memory once. Plans and masks are built once per step, by the first layer.

On CPU in float32, decodes go to a compiled kernel instead (workers/kernels/cpu_kernels.py,
csrc/paged_decode.cpp). It walks each row's block table and reads K and V in place with
an online softmax, so no gathered copy is written and read again.

On CUDA, a step whose metadata carries `KernelTables` (the runner builds them when the
Triton backend is on) runs three Triton launches per layer whatever its shape: the KV
write, flash-decoding over the decode rows, and one variable-length causal kernel over
every other row (workers/kernels/triton_attention.py). The Llama layers hand RoPE to these
launches (`KernelRope`): the decode kernel rotates its rows and writes their K/V itself, and
one `rope_write_kv` launch does the other rows', so a decode step's attention is one launch
(plus flash-decoding's combine) and a mixed step's three. Nothing is gathered, no mask is
built and no per-sequence loop runs on the host, so the step is CUDA-graph capturable.
The torch path stays for every other device and dtype, and wherever Triton is missing.

An FP8 cache (`kv_cache_dtype` fp8) holds fp8(k / k_scale) and fp8(v / v_scale), the layer's
scales read through the cache tensor (workers/kernels/kv_quant.py). The torch path quantizes as
it writes and dequantizes what it gathers; a fresh prompt attends to its K/V rounded as the cache
holds them, so a prefix hit and a recompute see the same keys. The CPU decode kernel reads float
caches only: FP8 decodes take the torch path. The Triton kernels dequantize in registers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.workers.kernels import cpu_kernels, kv_quant

# Most bytes one group's gathered K (and again V) may take. On CPU the copies must still be
# in cache (L2, or L3 at worst) when SDPA reads them; 1-4 MiB measured alike, 16 MiB was as
# slow as one padded batch. Elsewhere the bound only caps the copies' memory.
GROUP_BYTES = {"cpu": 2 << 20}
DEFAULT_GROUP_BYTES = 256 << 20


@dataclass
class PrefillSeq:
    q_start: int  # index of the chunk's first token in the step's flattened tokens
    q_len: int
    ctx_len: int  # tokens of this sequence whose KV exists after this step (prefix + chunk)
    block_ids: list[int]  # [ceil(ctx_len / bs)] (host list: the kernel path never needs a tensor of it)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> mask
    block_index: torch.Tensor | None = None  # block_ids on the device, made by the first layer that gathers

    def block_tensor(self, device: torch.device) -> torch.Tensor:
        if self.block_index is None:
            self.block_index = torch.tensor(self.block_ids, dtype=torch.long, device=device)
        return self.block_index


@dataclass
class KernelTables:
    """What the GPU kernels read, on the device (int32). Decode rows come first in the step;
    every other row belongs to a sequence of the prefill part."""

    decode_block_tables: torch.Tensor | None  # [num_decodes, width]
    decode_seq_lens: torch.Tensor | None  # [num_decodes] context length, this step's token included
    num_splits: int  # flash-decoding splits per row (fixed per CUDA-graph bucket)
    prefill_block_tables: torch.Tensor | None  # [num_prefills, width]
    prefill_seq_lens: torch.Tensor | None  # [num_prefills] context length after this step
    prefill_query_start: torch.Tensor | None  # [num_prefills + 1] offsets among the prefill rows
    prefill_max_query_len: int
    # A mixed step padded to a CUDA-graph bucket (mixed_graphs.py): decode_* hold a fixed number
    # of rows (those past the step's decodes have length 0) and prefill_* a fixed number of
    # sequences (length-0 queries past the step's), with query offsets among all the step's
    # tokens. Every shape is the bucket's, whatever the step holds.
    fixed_layout: bool = False


@dataclass
class DecodeGroup:
    """Decodes attended by one SDPA call over their gathered, padded blocks."""

    rows: torch.Tensor  # [n] the decodes' indices among the step's tokens
    block_ids: torch.Tensor  # [n * width] blocks to gather, row after row, padded with block 0
    num_rows: int
    num_keys: int  # keys kept per row: the padded tail of the last block is cut off
    mask: torch.Tensor | None  # [n, 1, 1, num_keys] keys each row sees; None: all of them


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int
    # Host lists, not tensors: decode groups are planned on the host, reading nothing back.
    decode_block_tables: list[list[int]] | None  # per decode: blocks covering its context
    decode_seq_lens: list[int] | None  # per decode: context length, this step's token included
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_size: int = 16
    # window -> this step's decode groups (every layer has the same KV shape, so they share
    # them); bench replays clear it to pay again.
    decode_groups_by_window: dict[int | None, list[DecodeGroup]] = field(default_factory=dict)
    kernel_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # see kernel_tables
    gpu: KernelTables | None = None  # set: the Triton kernels attend (see paged_attention)

    def kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [num_decodes, widest] and lengths as int32 tensors, for the CPU kernel
        (built once per step, by the first layer)."""
        if self.kernel_inputs is None:
            width = max(len(t) for t in self.decode_block_tables)
            self.kernel_inputs = (
                torch.tensor([t + [0] * (width - len(t)) for t in self.decode_block_tables], dtype=torch.int32),
                torch.tensor(self.decode_seq_lens, dtype=torch.int32))
        return self.kernel_inputs

    def decode_groups(self, window: int | None, max_group_blocks: int, device: torch.device) -> list[DecodeGroup]:
        groups = self.decode_groups_by_window.get(window)
        if groups is None:
            groups = plan_decode_groups(self.decode_block_tables, self.decode_seq_lens, self.block_size,
                                        window, max_group_blocks, device)
            self.decode_groups_by_window[window] = groups
        return groups


def plan_decode_groups(tables: list[list[int]], seq_lens: list[int], block_size: int, window: int | None,
                       max_group_blocks: int, device: torch.device) -> list[DecodeGroup]:
    """Groups of decodes, longest first. A group closes before a row that would take it past
    max_group_blocks gathered blocks, or that would be padded to more than twice its own blocks."""
    bs = block_size
    # Blocks wholly before a row's window are never read: a row gathers blocks [first, end).
    firsts = [0 if window is None else max(0, n - window) // bs for n in seq_lens]
    spans = [len(t) - f for t, f in zip(tables, firsts)]
    order = sorted(range(len(seq_lens)), key=spans.__getitem__, reverse=True)
    groups: list[DecodeGroup] = []
    start = 0
    for i in range(1, len(order) + 1):
        width = spans[order[start]]
        if i == len(order) or (i - start + 1) * width > max_group_blocks or 2 * spans[order[i]] < width:
            rows = order[start:i]
            block_ids = [b for r in rows for b in tables[r][firsts[r]:] + [0] * (width - spans[r])]
            # Row r's key j is position firsts[r] * bs + j; it sees keys [lo, hi).
            his = [seq_lens[r] - firsts[r] * bs for r in rows]
            los = [0 if window is None else max(0, seq_lens[r] - window) - firsts[r] * bs for r in rows]
            num_keys = max(his)
            mask = None
            if any(los) or min(his) < num_keys:
                keys = torch.arange(num_keys, device=device)
                lo = torch.tensor(los, device=device)[:, None]
                hi = torch.tensor(his, device=device)[:, None]
                mask = ((keys >= lo) & (keys < hi))[:, None, None, :]
            groups.append(DecodeGroup(torch.tensor(rows, device=device),
                                      torch.tensor(block_ids, device=device), len(rows), num_keys, mask))
            start = i
    return groups


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(block_ids) * block_size, kv_heads, head_dim]: the blocks' slots, in order.

    index_select over whole blocks copies each block as one contiguous run, where indexing
    the [slots, kv_heads, head_dim] view element-wise is about twice as slow.
    """
    _, kv_heads, head_dim = cache.shape
    blocks = cache.view(-1, block_size * kv_heads * head_dim)
    return blocks.index_select(0, block_ids).view(-1, kv_heads, head_dim)


def prefill_mask(seq: PrefillSeq, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[q_len, ctx_len] bool mask of keys each query sees; None = plain causal over the chunk."""
    if window in seq.masks:
        return seq.masks[window]
    fresh = seq.ctx_len == seq.q_len
    if fresh and (window is None or seq.ctx_len <= window):
        seq.masks[window] = None
        return None
    q_pos = torch.arange(seq.ctx_len - seq.q_len, seq.ctx_len, device=device)[:, None]
    k_pos = torch.arange(seq.ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    seq.masks[window] = mask
    return mask


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's K/V into their slots; an FP8 cache stores them quantized with its layer's scales."""
    slot_mapping = slot_mapping.long()  # a no-op for int64; the runner's staging buffer is int32
    k_scale, v_scale = kv_quant.scales_of(key_cache)
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        kv_quant.storage(cache).index_copy_(0, slot_mapping, kv_quant.storage(kv_quant.quantize(x, scale, cache.dtype)))


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None, out: torch.Tensor) -> None:
    """Attention of the step's decodes (query rows [0, num_decodes)), written into out's rows."""
    kernel = cpu_kernels.active_for(query) if key_cache.dtype == query.dtype else None  # float caches only
    if kernel is not None:
        n = meta.num_decodes
        tables, lens = meta.kernel_tables()
        kernel.paged_decode(query[:n], key_cache, value_cache, tables, lens, meta.block_size, scale, window or 0,
                            out[:n])
        return
    _, kv_heads, head_dim = key_cache.shape
    bs = meta.block_size
    block_bytes = bs * kv_heads * head_dim * query.element_size()  # as SDPA reads it (FP8: dequantized)
    max_group_blocks = GROUP_BYTES.get(query.device.type, DEFAULT_GROUP_BYTES) // block_bytes
    k_scale, v_scale = kv_quant.scales_of(key_cache)
    for group in meta.decode_groups(window, max_group_blocks, query.device):
        n = group.num_rows
        k = _gather(key_cache, group.block_ids, bs, k_scale, query.dtype).view(n, -1, kv_heads, head_dim)
        v = _gather(value_cache, group.block_ids, bs, v_scale, query.dtype).view(n, -1, kv_heads, head_dim)
        k, v = k[:, :group.num_keys], v[:, :group.num_keys]
        # GQA without repeating K/V: a KV head's query heads act as its queries. Every query
        # of a row sees the same keys, so the per-row mask holds for all of them.
        q = query.index_select(0, group.rows).view(n, kv_heads, -1, head_dim)  # [n, kvh, heads/kvh, hd]
        with _sdpa_backends(query.device):
            o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask,
                                               scale=scale)
        out.index_copy_(0, group.rows, o.reshape(n, -1, head_dim))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; key/value: this step's [num_tokens, kv_heads, head_dim].

    Writes this step's KV into the cache, then attends. Returns [num_tokens, num_heads * head_dim].
    """
    if meta.gpu is not None:
        return kernel_attention(query, key, value, key_cache, value_cache, meta, scale, window)
    write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    bs = meta.block_size
    if meta.num_decodes:
        decode_attention(query, key_cache, value_cache, meta, scale, window, out)
    k_scale, v_scale = kv_quant.scales_of(key_cache)
    for seq in meta.prefills:
        q = query[seq.q_start:seq.q_start + seq.q_len].transpose(0, 1)  # [h, q_len, hd]
        mask = prefill_mask(seq, window, query.device)
        if seq.ctx_len == seq.q_len:
            # Fresh prompt: this step's K/V are the whole context; no gather needed (an FP8
            # cache's rounding applied, so the keys are those a later prefix hit reads).
            k = _as_cached(key[seq.q_start:seq.q_start + seq.q_len], key_cache.dtype, k_scale)
            v = _as_cached(value[seq.q_start:seq.q_start + seq.q_len], value_cache.dtype, v_scale)
        else:
            blocks = seq.block_tensor(query.device)
            k = _gather(key_cache, blocks, bs, k_scale, query.dtype)[:seq.ctx_len]
            v = _gather(value_cache, blocks, bs, v_scale, query.dtype)[:seq.ctx_len]
        # 4-D (a batch of one): torch's CPU flash kernel only takes batched inputs; 3-D ones
        # fall to the math path, which materialises the scores.
        with _sdpa_backends(query.device):
            o = F.scaled_dot_product_attention(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
        out[seq.q_start:seq.q_start + seq.q_len] = o[0].transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """`gather_blocks` in the compute dtype (an FP8 cache's blocks copied as bytes, then dequantized)."""
    blocks = gather_blocks(kv_quant.storage(cache), block_ids, block_size).view(cache.dtype)
    return kv_quant.dequantize(blocks, scale, dtype)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` gives it back: itself, or quantized and dequantized for FP8."""
    if not kv_quant.is_fp8(cache_dtype):
        return x
    return kv_quant.dequantize(kv_quant.quantize(x, scale, cache_dtype), scale, x.dtype)


class KernelRope(NamedTuple):
    """RoPE for `kernel_attention` to apply: the cos/sin tables ([max_positions, head_dim], the
    query's dtype) and the step's positions."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor


def kernel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     window: int | None, rope: KernelRope | None = None) -> torch.Tensor:
    """The Triton path: [num_tokens, num_heads * head_dim].

    With `rope`, q and k are not rotated yet, and RoPE and this step's KV write happen in the
    attention launches: the decode rows' inside the decode kernel, the other rows' in one
    `rope_write_kv` launch before the variable-length kernel. A pure decode step's attention is
    then one launch (two where flash-decoding combines splits), a mixed step's three. Without
    `rope` q and k are rotated already, and one `write_kv` launch writes K/V first."""
    from tandem.workers.kernels import triton_attention as kernels

    tables = meta.gpu
    num_tokens, num_heads, head_dim = query.shape
    if tables.fixed_layout:
        return _fixed_layout_attention(query, key, value, key_cache, value_cache, meta, scale, window, rope)
    n = meta.num_decodes
    scales = kv_quant.scales_of(key_cache)  # (1.0, 1.0) unless FP8; read every step: the loader may set them
    if rope is None:
        kernels.write_kv(key, value, key_cache, value_cache, meta.slot_mapping, *scales)
    elif num_tokens > n:
        from tandem.workers.kernels.triton_ops import rope_write_kv

        rope_write_kv(query[n:], key[n:], value[n:], rope.cos, rope.sin, rope.positions[n:], key_cache, value_cache,
                      meta.slot_mapping[n:], *scales)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if n:
        decode_rope = None if rope is None else kernels.DecodeRope(key[:n], value[:n], rope.cos, rope.sin,
                                                                   rope.positions[:n], meta.slot_mapping[:n])
        kernels.decode_attention(query[:n], key_cache, value_cache, tables.decode_block_tables,
                                 tables.decode_seq_lens, meta.block_size, scale, window or 0, out[:n],
                                 tables.num_splits, decode_rope, *scales)
    if num_tokens > n:
        kernels.prefill_attention(query[n:], key_cache, value_cache, tables.prefill_block_tables,
                                  tables.prefill_seq_lens, tables.prefill_query_start, tables.prefill_max_query_len,
                                  meta.block_size, scale, window or 0, out[n:], *scales)
    return out.view(num_tokens, num_heads * head_dim)


def _fixed_layout_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
                            rope: KernelRope | None) -> torch.Tensor:
    """`kernel_attention` over a padded mixed step (`KernelTables.fixed_layout`), with the same
    three launches whatever the step holds: RoPE and the KV write over every token (padding
    tokens have slot -1), decode attention over the bucket's decode rows (rows past the step's
    decodes have no keys and come out zero), then the variable-length kernel over every token
    at its sequence's offset, which writes the prefill rows over those zeros."""
    from tandem.workers.kernels import triton_attention as kernels
    from tandem.workers.kernels.triton_ops import rope_write_kv

    tables = meta.gpu
    num_tokens, num_heads, head_dim = query.shape
    scales = kv_quant.scales_of(key_cache)
    if rope is None:
        kernels.write_kv(key, value, key_cache, value_cache, meta.slot_mapping, *scales)
    else:
        rope_write_kv(query, key, value, rope.cos, rope.sin, rope.positions, key_cache, value_cache,
                      meta.slot_mapping, *scales)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    d = tables.decode_seq_lens.shape[0]
    kernels.decode_attention(query[:d], key_cache, value_cache, tables.decode_block_tables, tables.decode_seq_lens,
                             meta.block_size, scale, window or 0, out[:d], tables.num_splits, None, *scales)
    kernels.prefill_attention(query, key_cache, value_cache, tables.prefill_block_tables, tables.prefill_seq_lens,
                              tables.prefill_query_start, tables.prefill_max_query_len, meta.block_size, scale,
                              window or 0, out, *scales)
    return out.view(num_tokens, num_heads * head_dim)


def _sdpa_backends(device: torch.device):
    """On CUDA, SDPA without cuDNN: it builds a new plan, on the CPU, for every new shape, and a
    step's shapes change all the time. Elsewhere no restriction."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
