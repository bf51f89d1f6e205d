"""One step's tensors, built on the host with numpy and sent to the device in one copy.

The scheduler's output becomes a handful of int32 arrays, packed back to back in one
pinned staging buffer and copied to the device with a single non-blocking copy; the
step's tensors are views into that one device buffer:

    | input_ids | positions | slot_mapping | logits_index | seq_lens | query_start | block_tables |
      T           T           T              L              R          P + 1         R x W

T tokens, R requests (decodes first, then the rest), L rows to score, P non-decode
requests, W block-table width. A decode batch that runs as a CUDA graph is padded to its
bucket (B rows, W = the graph's width) and lands in the graph's own input buffer instead;
padding rows read and write only the scratch block, which no request ever holds.

Built inputs take tokens still on the device without a trip through the host: `copy_pending`
copies in those of requests scheduled ahead, `advance_decodes` moves a decode step on by one
token (a multi-step step's next pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tandem.workers.core.scheduler_output import SchedulerOutput
from tandem.workers.kernels import gpu_kernels
from tandem.workers.model.attention import AttentionMetadata, KernelTables, PrefillSeq
from tandem.workers.runner.block_table import BlockTable
from tandem.workers.runner.graph_inputs import GraphTarget, MixedTarget, mixed_layout, mixed_step_views
from tandem.workers.runner.staging import StagingBuffer, split_views
from tandem.workers.runner.step_rows import (
    RequestView,
    StepRows,
    add_prefill_chunks,
    decode_rows,
    logits_index,
    slot_mapping,
    step_order,
)


@dataclass
class StepInputs:
    """One step's tensors, plus which rows of the last hidden states to score."""

    input_ids: torch.Tensor  # [num_tokens] (padded to the graph bucket for graph steps)
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    req_ids: list[str]  # in the order their tokens appear
    logits_rows: list[list[int]]  # per request: token indices to score ([] = partial prefill)
    logits_index: torch.Tensor  # [rows to score]: the flattened logits_rows, on the device
    drafts: list[list[int]]
    # Requests asking for prompt logprobs: (req_id, first prompt index scored, token rows, prompt tokens)
    prompt_rows: list[tuple[str, int, list[int], list[int]]] = field(default_factory=list)
    graph_batch: int | None = None  # the decode CUDA-graph bucket this step is padded to
    graph_tokens: int | None = None  # the mixed CUDA-graph bucket (tokens) this step is padded to
    staged: torch.Tensor | None = None  # the packed int32 inputs on the device (all views above)
    # Token indices holding PENDING_TOKEN, and where their tokens are among the previous step's
    # sampled ones (int32, on the device): the runner copies them in before the forward.
    pending_dst: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None

    @property
    def in_graph(self) -> bool:
        """Padded to a graph bucket (decode or mixed): its forward replays that graph."""
        return self.graph_batch is not None or self.graph_tokens is not None

    @property
    def num_scored(self) -> int:
        return sum(len(rows) for rows in self.logits_rows)


class _DeviceViews(NamedTuple):
    """A step's packed inputs on the device (`staged`) and the views of it the step reads."""

    staged: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_index: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor | None  # None for a decode graph step: it has no prefills
    block_tables: torch.Tensor  # flat: rows x width
    pending_dst: torch.Tensor
    pending_src: torch.Tensor


class InputBuilder:
    """Scheduler output + per-request state -> StepInputs, with one host-to-device copy.

    Runs on the host for every step: it gathers the step's rows (step_rows.py, a few list
    appends per request), packs them as the layout above says (or a graph bucket's), and
    uploads them in one copy.
    """

    def __init__(self, block_size: int, device: torch.device, scratch_block: int, kernel_tables: bool,
                 num_splits: Callable[[int, int], int], host_lists: bool = True) -> None:
        self.block_size = block_size
        self.device = device
        self.scratch_block = scratch_block  # padding rows' KV goes here
        self.kernel_tables = kernel_tables  # build the GPU kernels' tables (the Triton backend)
        self.num_splits = num_splits  # (batch, max context) -> flash-decoding splits
        # The decodes' block lists on the host (AttentionMetadata.decode_block_tables): the torch
        # path and the overlapped TP chunks read them, the Triton kernels read the tables.
        self.host_lists = host_lists or not kernel_tables
        self.staging = StagingBuffer(device)

    def build(self, out: SchedulerOutput, states: dict[str, RequestView], block_table: BlockTable,
              graph: GraphTarget | MixedTarget | None = None, pending_source: dict[str, int] | None = None,
              advance: int = 0, passes_after: int = 0) -> StepInputs:
        """`pending_source`: request -> its token's index among the previous step's sampled
        tokens, for requests scheduled ahead on a PENDING_TOKEN. `graph`: a step of single-token
        rows only, padded to a decode graph's bucket (GraphTarget), or a mixed step padded to a
        mixed graph's (MixedTarget). Multi-step decoding: `advance` is the forward
        pass this is (its rows that many tokens further on than the step's first pass), and
        `passes_after` how many passes follow it, which the block tables are made wide enough
        for (`advance_decodes` moves these inputs on in place)."""
        computed = {r.req_id: r.num_computed_tokens + advance for r in out.new_requests}
        computed.update({r.req_id: r.num_computed_tokens + advance for r in out.cached_requests})
        order, num_decodes = step_order(out)
        mixed = graph if isinstance(graph, MixedTarget) else None
        if mixed is not None:
            graph = None  # the decode-graph padding below is not this step's
        rows = decode_rows(order, num_decodes, states, computed, pending_source, self.block_size, self.host_lists)
        add_prefill_chunks(rows, states, computed, out.num_scheduled_tokens, out.spec_token_ids, self.block_size)
        all_ends = rows.seq_lens + [s + n for s, n in zip(rows.prefill_starts, rows.prefill_nums)]
        target = mixed if mixed is not None else graph
        width = target.width if target is not None else -(-(max(all_ends) + passes_after) // self.block_size)
        tables = self._block_tables(rows, block_table, graph, width)
        query_start, positions, slots = slot_mapping(rows, tables, self.block_size)
        prefills = [PrefillSeq(len(rows.seq_lens) + int(q), n, s + n, blocks) for q, n, s, blocks
                    in zip(query_start[:-1], rows.prefill_nums, rows.prefill_starts, rows.prefill_lists)]
        scored = logits_index(rows)
        if mixed is not None:
            return self._mixed_step(mixed, rows, positions, slots, scored, all_ends[num_decodes:], query_start,
                                    tables, prefills)
        if graph is not None:
            return self._graph_step(graph, rows, scored, tables, prefills)
        return self._eager_step(rows, positions, slots, scored, all_ends, query_start, tables, width, prefills)

    @staticmethod
    def _block_tables(rows: StepRows, block_table: BlockTable, graph: GraphTarget | None,
                      width: int) -> np.ndarray:
        """The requests' block tables, `width` wide; a decode graph's padded to its bucket."""
        if graph is None:
            return block_table.rows(np.asarray(rows.table_rows, dtype=np.int64), width)
        tables = np.zeros((graph.batch, width), dtype=np.int32)
        tables[:len(rows.order)] = block_table.rows(np.asarray(rows.table_rows, dtype=np.int64), width)
        return tables

    def _graph_step(self, graph: GraphTarget, rows: StepRows, scored: list[int], tables: np.ndarray,
                    prefills: list[PrefillSeq]) -> StepInputs:
        """The decode batch padded to its bucket (padding rows read the scratch block only),
        copied into the graph's own buffer."""
        bs, num_rows, num_reqs = self.block_size, graph.batch, len(rows.order)
        pad = num_rows - num_reqs
        tables[num_reqs:, 0] = self.scratch_block
        head = (rows.input_ids + [0] * pad + rows.positions + [0] * pad + rows.slots + [self.scratch_block * bs] * pad
                + rows.seq_lens + [1] * pad)
        if self.host_lists:
            rows.decode_lists += [[self.scratch_block]] * pad
        # A graph step scores its first rows in order (logits_index empty), unless a 1-token
        # prefill chunk that scores nothing comes before a row that does: then the scored
        # rows travel with the step's inputs, so picking them never copies from the host.
        picked = scored if scored and scored[-1] != len(scored) - 1 else []
        pending_dst, pending_src = rows.pending_dst, rows.pending_src
        dev = self.staging.upload([np.asarray(head, dtype=np.int32), tables.reshape(-1),
                                   np.asarray(pending_dst + pending_src + picked, dtype=np.int32)], graph.buffer)
        d_ids, d_pos, d_slots, d_lens, d_tables, d_dst, d_src, d_scored = split_views(
            dev, [num_rows, num_rows, num_rows, num_rows, num_rows * graph.width, len(pending_dst), len(pending_src),
                  len(picked)])
        views = _DeviceViews(dev, d_ids, d_pos, d_slots, d_scored, d_lens, None, d_tables, d_dst, d_src)
        return self._step_inputs(rows, views, num_rows, rows.seq_lens + [1] * pad, graph.width, prefills, graph)

    def _eager_step(self, rows: StepRows, positions: list[int] | np.ndarray, slots: list[int] | np.ndarray,
                    scored: list[int], all_ends: list[int], query_start: np.ndarray, tables: np.ndarray, width: int,
                    prefills: list[PrefillSeq]) -> StepInputs:
        """The step packed as the module's layout says, copied to the device."""
        num_tokens, num_rows = len(rows.input_ids), len(rows.order)
        pending_dst, pending_src = rows.pending_dst, rows.pending_src
        dev = self.staging.upload([np.asarray(rows.input_ids, dtype=np.int32), np.asarray(positions, dtype=np.int32),
                                   np.asarray(slots, dtype=np.int32),
                                   np.asarray(scored + all_ends, dtype=np.int32), query_start,
                                   tables.reshape(-1), np.asarray(pending_dst + pending_src, dtype=np.int32)])
        d_ids, d_pos, d_slots, d_scored, d_lens, d_qstart, d_tables, d_dst, d_src = split_views(
            dev, [num_tokens, num_tokens, num_tokens, len(scored), num_rows, len(query_start), num_rows * width,
                  len(pending_dst), len(pending_src)])
        views = _DeviceViews(dev, d_ids, d_pos, d_slots, d_scored, d_lens, d_qstart, d_tables, d_dst, d_src)
        return self._step_inputs(rows, views, rows.num_decodes, rows.seq_lens, width, prefills, None)

    def _step_inputs(self, rows: StepRows, views: _DeviceViews, num_decodes: int, decode_lens: list[int],
                     width: int, prefills: list[PrefillSeq], graph: GraphTarget | None) -> StepInputs:
        """A decode graph step's or an eager step's StepInputs, on its views of the device buffer."""
        num_rows = graph.batch if graph is not None else len(rows.order)
        positions = views.positions
        if self.device.type == "cpu" and not self.kernel_tables:
            positions = positions.long()  # the CPU RoPE kernel indexes its tables with int64 (Triton's takes the view)
        meta = self._metadata(num_decodes, decode_lens, rows.decode_lists, prefills, views.slot_mapping,
                              views.seq_lens, views.block_tables.view(num_rows, width), views.query_start,
                              max(rows.prefill_nums, default=0), graph)
        inputs = StepInputs(views.input_ids, positions, meta, rows.order, rows.logits_rows, views.logits_index,
                            rows.drafts, rows.prompt_rows, graph_batch=graph.batch if graph is not None else None,
                            staged=views.staged)
        if rows.pending_dst:
            inputs.pending_dst, inputs.pending_src = views.pending_dst, views.pending_src
        return inputs

    def _mixed_step(self, target: MixedTarget, rows: StepRows, positions: list[int] | np.ndarray,
                    slots: list[int] | np.ndarray, scored: list[int], prefill_ends: list[int], query_start: np.ndarray,
                    tables: np.ndarray, prefills: list[PrefillSeq]) -> StepInputs:
        """A mixed step padded to `target`'s bucket, copied into its buffer (`mixed_layout`),
        its tensors each the bucket's size. Padding tokens write no KV (slot -1), padding decode
        rows and prefill sequences have nothing to attend (length 0, empty queries at the end)."""
        t, d, p, w = target.tokens, target.decodes, target.prefills, target.width
        num_tokens, num_decodes, num_prefills = len(rows.input_ids), len(rows.seq_lens), len(prefill_ends)
        pending_dst, pending_src = rows.pending_dst, rows.pending_src
        sizes = mixed_layout(t, d, p, w)
        image = np.zeros(sum(sizes[:-1]), dtype=np.int32)  # all but the decode tables, copied row by row
        h_ids, h_pos, h_slots, h_scored, h_lens, h_ends, h_qstart, h_tables, h_dst, h_src = split_views(
            image, sizes[:-1])
        h_ids[:num_tokens] = rows.input_ids
        h_pos[:num_tokens] = positions
        h_slots[:] = -1
        h_slots[:num_tokens] = slots
        h_scored[:len(scored)] = scored
        h_lens[:num_decodes] = rows.seq_lens
        h_ends[:num_prefills] = prefill_ends
        h_qstart[:] = num_tokens  # padding sequences: empty queries past the last token
        h_qstart[:num_prefills + 1] = query_start + num_decodes  # offsets among all the step's tokens
        h_tables.reshape(p, w)[:num_prefills] = tables[num_decodes:]
        h_dst[:len(pending_dst)] = pending_dst
        h_src[:len(pending_src)] = pending_src
        self.staging.upload([image, tables[:num_decodes].reshape(-1)], target.buffer)
        d_ids, d_pos, meta, d_scored, d_dst, d_src = mixed_step_views(
            target.buffer, target, self.block_size, rows.seq_lens, rows.decode_lists, prefills)
        inputs = StepInputs(d_ids, d_pos, meta, rows.order, rows.logits_rows, d_scored, rows.drafts, rows.prompt_rows,
                            staged=target.buffer, graph_tokens=target.tokens)
        if pending_dst:
            inputs.pending_dst, inputs.pending_src = d_dst[:len(pending_dst)], d_src[:len(pending_src)]
        return inputs

    def _metadata(self, num_decodes: int, decode_lens: list[int], decode_lists: list[list[int]],
                  prefills: list[PrefillSeq], slots: torch.Tensor, d_lens: torch.Tensor, d_tables: torch.Tensor,
                  d_qstart: torch.Tensor | None, max_query_len: int, graph: GraphTarget | None) -> AttentionMetadata:
        gpu = None
        if self.kernel_tables:
            if graph is not None:
                splits = graph.num_splits
            else:
                splits = self.num_splits(num_decodes, max(decode_lens)) if num_decodes else 1
            gpu = KernelTables(
                decode_block_tables=d_tables[:num_decodes] if num_decodes else None,
                decode_seq_lens=d_lens[:num_decodes] if num_decodes else None,
                num_splits=splits,
                prefill_block_tables=d_tables[num_decodes:] if prefills else None,
                prefill_seq_lens=d_lens[num_decodes:] if prefills else None,
                prefill_query_start=d_qstart if prefills else None,
                prefill_max_query_len=max_query_len)
        return AttentionMetadata(
            slot_mapping=slots,
            num_decodes=num_decodes,
            decode_block_tables=decode_lists or None,
            decode_seq_lens=decode_lens or None,
            prefills=prefills,
            block_size=self.block_size,
            gpu=gpu,
        )


def copy_pending(inputs: StepInputs, tokens: torch.Tensor) -> None:
    """The tokens of requests scheduled ahead (`inputs.pending_*`), from `tokens` (the last
    step's sampled ids, on the device) into the step's input ids: one Triton launch on the
    GPU kernels' path, torch's index ops elsewhere."""
    gpu = gpu_kernels.active_for(tokens)
    if gpu is not None:
        gpu.copy_pending(inputs.input_ids, inputs.pending_dst, inputs.pending_src, tokens)
        return
    picked = tokens.index_select(0, inputs.pending_src.long())
    inputs.input_ids.index_copy_(0, inputs.pending_dst.long(), picked.to(inputs.input_ids.dtype))


def advance_decodes(inputs: StepInputs, tokens: torch.Tensor, block_size: int) -> None:
    """Move a step of decodes on by one token, in place, on the device (a multi-step step's next
    pass, on the GPU kernels' tables): each row's input becomes the token it has just sampled
    (`tokens`, one a row), one position further on, its context one longer, its KV slot looked up
    in its block table. Padding rows stay as they are (the scratch block)."""
    tables = inputs.meta.gpu
    n = tokens.shape[0]
    inputs.input_ids[:n].copy_(tokens)
    positions = inputs.positions[:n]
    positions += 1
    tables.decode_seq_lens[:n] += 1
    blocks = tables.decode_block_tables[:n].gather(1, (positions // block_size).long()[:, None])[:, 0]
    inputs.meta.slot_mapping[:n] = blocks * block_size + positions % block_size
