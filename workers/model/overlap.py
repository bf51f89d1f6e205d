"""Micro-chunks for overlapping TP all-reduces with computation.

A step's flattened tokens are cut into contiguous chunks. Attention metadata is cut
the same way, so each chunk runs the whole layer on its own: a prefill sequence that
straddles a boundary becomes two pieces, and the second attends to the first through
the KV cache (the first chunk wrote it earlier in the same layer), exactly as a
chunked prefill would. While one chunk's all-reduce is in flight, the other chunk's
GEMMs and attention run.

The Triton kernels' tables are cut too, so a chunk attends on the same path as the whole
step would: a chunk's decode rows are slices of the step's tables (nothing is built on the
host), and its prefill pieces get their rows, context lengths and query offsets (two small
tensors, only for a chunk holding a prefill piece).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from tandem.workers.model.attention import AttentionMetadata, KernelTables, PrefillSeq


@dataclass
class Pending:
    """A partial sum whose all-reduce may still be in flight (handle None: nothing to wait
    for, the partial is the sum)."""

    handle: Any  # wait() returns the sum over ranks
    partial: torch.Tensor


def settle(x: torch.Tensor, pending: Pending | None) -> torch.Tensor:
    """x plus the reduced partial sum, once its all-reduce has finished."""
    if pending is None:
        return x
    return x + (pending.handle.wait() if pending.handle is not None else pending.partial)


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """[start, end) of num_chunks near-equal token chunks."""
    base, extra = divmod(num_tokens, num_chunks)
    bounds, start = [], 0
    for c in range(num_chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def split_metadata(meta: AttentionMetadata, bounds: list[tuple[int, int]]) -> list[AttentionMetadata]:
    """Per chunk, the metadata of its tokens alone (token indices rebased to the chunk)."""
    return [_chunk_metadata(meta, a, b) for a, b in bounds]


def _chunk_metadata(meta: AttentionMetadata, a: int, b: int) -> AttentionMetadata:
    # Decodes are the step's first num_decodes tokens, one per sequence.
    d_start, d_end = min(a, meta.num_decodes), min(b, meta.num_decodes)
    num_decodes = d_end - d_start
    prefills: list[PrefillSeq] = []
    rows: list[int] = []  # which of the step's prefill sequences each piece comes from
    for i, seq in enumerate(meta.prefills):
        q_end = seq.q_start + seq.q_len
        start, end = max(seq.q_start, a), min(q_end, b)
        if start >= end:
            continue
        # Keys after this piece are not there yet: the context ends with the piece.
        prefills.append(PrefillSeq(start - a, end - start, seq.ctx_len - (q_end - end), seq.block_ids))
        rows.append(i)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[a:b],
        num_decodes=num_decodes,
        decode_block_tables=meta.decode_block_tables[d_start:d_end] if num_decodes and meta.decode_block_tables
        else None,
        decode_seq_lens=meta.decode_seq_lens[d_start:d_end] if num_decodes and meta.decode_seq_lens else None,
        prefills=prefills,
        block_size=meta.block_size,
        gpu=_chunk_tables(meta.gpu, d_start, d_end, prefills, rows) if meta.gpu is not None else None,
    )


def _chunk_tables(tables: KernelTables, d_start: int, d_end: int, pieces: list[PrefillSeq],
                  rows: list[int]) -> KernelTables:
    """One chunk's kernel tables: its decode rows, then its prefill pieces (from consecutive
    sequences of the step, each with its own context end; queries start after the decodes)."""
    num_decodes = d_end - d_start
    decode_tables = tables.decode_block_tables[d_start:d_end] if num_decodes else None
    decode_lens = tables.decode_seq_lens[d_start:d_end] if num_decodes else None
    if not pieces:
        return KernelTables(decode_tables, decode_lens, tables.num_splits, None, None, None, 0)
    device = tables.prefill_block_tables.device
    lens = torch.tensor([p.ctx_len for p in pieces], dtype=torch.int32, device=device)
    starts = torch.tensor([0, *itertools.accumulate(p.q_len for p in pieces)], dtype=torch.int32, device=device)
    return KernelTables(decode_tables, decode_lens, tables.num_splits,
                        tables.prefill_block_tables[rows[0]:rows[-1] + 1], lens, starts,
                        max(p.q_len for p in pieces))
