"""Where a step padded to a CUDA-graph bucket puts its inputs, and how they are laid out there.

A decode graph's bucket is a `GraphTarget`, a mixed graph's (prompt chunks beside decodes) a
`MixedTarget`: each names the bucket's padded shape and the persistent int32 buffer its graph
reads. The input builder packs a step into that buffer; the graphs read the same layout back
as views (`mixed_layout`, `mixed_step_views` for mixed steps; cuda_graphs.py for decode steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.workers.model.attention import AttentionMetadata, KernelTables, PrefillSeq
from tandem.workers.runner.staging import split_views


@dataclass(frozen=True)
class GraphTarget:
    """Where a padded decode step goes: a bucket's rows, its table width, its input buffer."""

    batch: int
    width: int
    buffer: torch.Tensor  # int32 device buffer the captured graph reads, laid out as step_inputs.py says
    num_splits: int  # flash-decoding splits captured into the bucket's graph


@dataclass(frozen=True)
class MixedTarget:
    """Where a padded mixed step goes (prompt chunks beside decodes): a token bucket, its decode
    rows and prefill sequence slots, its table width, its input buffer (`mixed_layout`)."""

    tokens: int
    decodes: int
    prefills: int
    width: int
    buffer: torch.Tensor  # int32 device buffer the captured graph reads
    num_splits: int  # flash-decoding splits of the decode rows, captured into the graph


def mixed_layout(tokens: int, decodes: int, prefills: int, width: int) -> list[int]:
    """Sizes of a padded mixed step's segments, in buffer order:

        | input_ids T | positions T | slot_mapping T | logits_index D + P | decode seq_lens D
        | prefill seq_lens P | query_start P + 1 | prefill tables P x W | pending dst D | pending src D
        | decode tables D x W |

    The decode tables come last: a step writes only its own decodes' rows of them (the other
    rows have length 0 and are never read), so the one copy stops at its last decode row."""
    return [tokens, tokens, tokens, decodes + prefills, decodes, prefills, prefills + 1, prefills * width, decodes,
            decodes, decodes * width]


def mixed_step_views(buffer: torch.Tensor, target: MixedTarget, block_size: int, decode_lens: list[int] | None = None,
                     decode_lists: list[list[int]] | None = None, prefills: list[PrefillSeq] | None = None):
    """A padded mixed step's tensors as views of its buffer (`mixed_layout`): (input_ids,
    positions, metadata, logits_index, pending dst, pending src), the kernels' tables in the
    bucket's fixed shapes (`KernelTables.fixed_layout`). `decode_lens`, `decode_lists`,
    `prefills`: the step's own decodes and prompt chunks, for the host side of the metadata
    (none for the all-padding step a graph is captured on)."""
    t, d, p, w = target.tokens, target.decodes, target.prefills, target.width
    ids, positions, slots, scored, d_lens, p_lens, q_start, p_tables, dst, src, d_tables = split_views(
        buffer, mixed_layout(t, d, p, w))
    gpu = KernelTables(decode_block_tables=d_tables.view(d, w), decode_seq_lens=d_lens, num_splits=target.num_splits,
                       prefill_block_tables=p_tables.view(p, w), prefill_seq_lens=p_lens,
                       prefill_query_start=q_start, prefill_max_query_len=t, fixed_layout=True)
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=len(decode_lens or []),
                             decode_block_tables=decode_lists or None, decode_seq_lens=decode_lens or None,
                             prefills=prefills or [], block_size=block_size, gpu=gpu)
    return ids, positions, meta, scored, dst, src
