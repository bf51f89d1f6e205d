"""Attention over a paged KV cache (torch reference path).

Cache layout per layer: key and value tensors of shape
    [num_blocks * block_size, num_kv_heads, head_dim]
A token at position p of a sequence lives in slot block_table[p // bs] * bs + p % bs.

A step's tokens are ordered decodes first (one token each, batched into one
SDPA call over block-table-gathered KV), then prefill chunks (several tokens
each; a chunk attends to its cached prefix plus itself, causally). Everything a
layer needs is built once per step in `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    q_start: int  # index of the chunk's first token in the step's flattened tokens
    q_len: int
    ctx_len: int  # tokens of this sequence whose KV exists after this step (prefix + chunk)
    block_ids: torch.Tensor  # [ceil(ctx_len / bs)]
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None  # [num_decodes]
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [D, 1, 1, L]
    prefills: list[PrefillSeq] = field(default_factory=list)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        mask = self.decode_masks.get(window)
        if mask is None:
            max_len = self.decode_block_tables.shape[1] * self.block_size
            key_pos = torch.arange(max_len, device=self.decode_seq_lens.device)
            seq = self.decode_seq_lens[:, None]
            mask = key_pos[None, :] < seq
            if window is not None:
                mask &= key_pos[None, :] > seq - 1 - window
            mask = mask[:, None, None, :]
            self.decode_masks[window] = mask
        return mask

    block_size: int = 16


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
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; key/value: this step's [num_tokens, kv_heads, head_dim].

    Writes this step's KV into the cache, then attends. Returns [num_tokens, num_heads * head_dim].
    """
    write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    bs = meta.block_size
    kv_heads = key_cache.shape[1]
    if meta.num_decodes:
        d = meta.num_decodes
        tables = meta.decode_block_tables
        k = key_cache.view(-1, bs, kv_heads, head_dim)[tables].flatten(1, 2)  # [D, L, kvh, hd]
        v = value_cache.view(-1, bs, kv_heads, head_dim)[tables].flatten(1, 2)
        q = query[:d].unsqueeze(2)  # [D, h, 1, hd]
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=meta.decode_mask(window), scale=scale, enable_gqa=True)
        out[:d] = o.squeeze(2)
    for seq in meta.prefills:
        q = query[seq.q_start:seq.q_start + seq.q_len].transpose(0, 1)  # [h, q_len, hd]
        mask = prefill_mask(seq, window, query.device)
        if seq.ctx_len == seq.q_len:
            # Fresh prompt: this step's K/V are the whole context; no gather needed.
            k = key[seq.q_start:seq.q_start + seq.q_len]
            v = value[seq.q_start:seq.q_start + seq.q_len]
        else:
            k = key_cache.view(-1, bs, kv_heads, head_dim)[seq.block_ids].flatten(0, 1)[:seq.ctx_len]
            v = value_cache.view(-1, bs, kv_heads, head_dim)[seq.block_ids].flatten(0, 1)[:seq.ctx_len]
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=True)
        out[seq.q_start:seq.q_start + seq.q_len] = o.transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
