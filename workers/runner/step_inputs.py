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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tandem.workers.core.request import PENDING_TOKEN, token_at, token_slice
from tandem.workers.core.scheduler_output import SchedulerOutput
from tandem.workers.model.attention import AttentionMetadata, KernelTables, PrefillSeq
from tandem.workers.runner.block_table import BlockTable


class RequestView(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    row: int  # its row of the BlockTable

    @property
    def num_tokens(self) -> int: ...


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
    graph_batch: int | None = None  # the CUDA-graph bucket this step is padded to
    staged: torch.Tensor | None = None  # the packed int32 inputs on the device (all views above)
    # Token indices holding PENDING_TOKEN, and where their tokens are among the previous step's
    # sampled ones (int32, on the device): the runner copies them in before the forward.
    pending_dst: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None

    @property
    def num_scored(self) -> int:
        return sum(len(rows) for rows in self.logits_rows)


@dataclass(frozen=True)
class GraphTarget:
    """Where a padded decode step goes: a bucket's rows, its table width, its input buffer."""

    batch: int
    width: int
    buffer: torch.Tensor  # int32 device buffer the captured graph reads, laid out as above


class StagingBuffer:
    """Pinned host memory for a step's packed inputs, two in turn, each reused only after
    its previous copy has been read (an event per buffer)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, segments: list[np.ndarray], dest: torch.Tensor | None = None) -> torch.Tensor:
        """The segments packed into one int32 array on the device (into `dest` when given)."""
        total = sum(len(s) for s in segments)
        if self.device.type != "cuda":
            packed = torch.from_numpy(np.concatenate(segments).astype(np.int32, copy=False))
            if dest is None:
                return packed
            dest[:total].copy_(packed)
            return dest[:total]
        turn = self._turn = 1 - self._turn
        host = self._host[turn]
        if host is None or host.numel() < total:
            host = self._host[turn] = torch.empty(max(total, 2 * (0 if host is None else host.numel()), 4096),
                                                  dtype=torch.int32, pin_memory=True)
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copy out of this buffer two steps ago has been read
        np.concatenate(segments, out=host[:total].numpy())
        out = dest[:total] if dest is not None else torch.empty(total, dtype=torch.int32, device=self.device)
        out.copy_(host[:total], non_blocking=True)
        if event is None:
            event = self._events[turn] = torch.cuda.Event()
        event.record()
        return out


class InputBuilder:
    """Scheduler output + per-request state -> StepInputs, with one host-to-device copy."""

    def __init__(self, block_size: int, device: torch.device, scratch_block: int, kernel_tables: bool,
                 num_splits: Callable[[int, int], int]) -> None:
        self.block_size = block_size
        self.device = device
        self.scratch_block = scratch_block  # padding rows' KV goes here
        self.kernel_tables = kernel_tables  # build the GPU kernels' tables (the Triton backend)
        self.num_splits = num_splits  # (batch, max context) -> flash-decoding splits
        self.staging = StagingBuffer(device)

    def build(self, out: SchedulerOutput, states: dict[str, RequestView], block_table: BlockTable,
              graph: GraphTarget | None = None, pending_source: dict[str, int] | None = None) -> StepInputs:
        """`pending_source`: request -> its token's index among the previous step's sampled
        tokens, for requests scheduled ahead on a PENDING_TOKEN."""
        bs = self.block_size
        computed = {r.req_id: r.num_computed_tokens for r in out.new_requests}
        computed.update({r.req_id: r.num_computed_tokens for r in out.cached_requests})
        sched = out.num_scheduled_tokens
        # Decodes (exactly one new token) first: they batch into one attention call.
        order = sorted(sched, key=lambda r: sched[r] != 1)
        num_reqs = len(order)
        num_decodes = sum(1 for r in order if sched[r] == 1)
        start_list = [computed[r] for r in order]
        num_list = [sched[r] for r in order]
        starts = np.array(start_list, dtype=np.int64)
        nums = np.array(num_list, dtype=np.int64)
        ends = starts + nums
        num_blocks = ((ends + bs - 1) // bs).tolist()
        rows = graph.batch if graph is not None else num_reqs
        width = graph.width if graph is not None else max(num_blocks)
        table_rows = np.array([states[r].row for r in order], dtype=np.int64)
        if graph is None:
            tables = block_table.rows(table_rows, width)
        else:
            tables = np.zeros((rows, width), dtype=np.int32)
            tables[:num_reqs] = block_table.rows(table_rows, width)
        input_ids: list[int] = []
        logits_rows: list[list[int]] = []
        drafts: list[list[int]] = []
        prompt_rows: list[tuple[str, int, list[int], list[int]]] = []
        block_lists: list[list[int]] = []
        spec = out.spec_token_ids
        pending_dst: list[int] = []
        pending_src: list[int] = []
        for req_id, start, num, blocks in zip(order, start_list, num_list, num_blocks):
            state = states[req_id]
            end = start + num
            draft = spec.get(req_id, ()) if spec else ()
            q_start = len(input_ids)
            if num == 1:  # the hot path: one token (a draft always comes with its token)
                token = token_at(state.prompt_token_ids, state.output_token_ids, start)
                if token == PENDING_TOKEN:  # scheduled ahead: the token is on the device
                    pending_dst.append(q_start)
                    pending_src.append(pending_source[req_id])
                input_ids.append(token)
                # Reaches the last known token: sample.
                logits_rows.append([q_start] if end >= state.num_tokens else [])
            else:
                input_ids.extend(token_slice(state.prompt_token_ids, state.output_token_ids, start,
                                             start + num - len(draft)))
                input_ids.extend(draft)
                # Reaches the last known token: sample (at each draft position too).
                logits_rows.append(list(range(q_start + num - 1 - len(draft), q_start + num))
                                   if end - len(draft) >= state.num_tokens else [])
            drafts.append(list(draft))
            block_lists.append(state.block_ids[:blocks])
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # Position p's logits score prompt token p + 1.
                last = min(end, num_prompt - 1)
                prompt_rows.append((req_id, start + 1, list(range(q_start, q_start + last - start)),
                                    state.prompt_token_ids[start + 1:last + 1]))
        num_tokens = len(input_ids)
        token_req = np.repeat(np.arange(num_reqs), nums)
        q_starts = np.cumsum(nums) - nums
        positions = (np.repeat(starts - q_starts, nums) + np.arange(num_tokens)).astype(np.int32)
        slots = (tables[token_req, positions // bs].astype(np.int64) * bs + positions % bs).astype(np.int32)
        seq_lens = ends.astype(np.int32)
        ids = np.asarray(input_ids, dtype=np.int32)
        if graph is not None:  # pad the decode batch to its bucket: rows read the scratch block only
            pad = rows - num_reqs
            tables[num_reqs:, 0] = self.scratch_block
            ids = np.concatenate([ids, np.zeros(pad, np.int32)])
            positions = np.concatenate([positions, np.zeros(pad, np.int32)])
            slots = np.concatenate([slots, np.full(pad, self.scratch_block * bs, np.int32)])
            seq_lens = np.concatenate([seq_lens, np.ones(pad, np.int32)])
            block_lists += [[self.scratch_block]] * pad
            num_decodes = rows
            dev = self.staging.upload([ids, positions, slots, seq_lens, tables.reshape(-1),
                                       np.array(pending_dst + pending_src, dtype=np.int32)], graph.buffer)
            views = _split(dev, [rows, rows, rows, rows, rows * width, len(pending_dst), len(pending_src)])
            d_ids, d_pos, d_slots, d_lens, d_tables, d_dst, d_src = views
            d_scored = d_ids[:0]  # a graph step scores its first len(order) rows, in order
        else:
            scored = np.asarray([r for req_rows in logits_rows for r in req_rows], dtype=np.int32)
            prefill_lens = nums[num_decodes:]
            query_start = np.concatenate([[0], np.cumsum(prefill_lens)]).astype(np.int32)
            dev = self.staging.upload([ids, positions, slots, scored, seq_lens, query_start, tables.reshape(-1),
                                       np.array(pending_dst + pending_src, dtype=np.int32)])
            d_ids, d_pos, d_slots, d_scored, d_lens, d_qstart, d_tables, d_dst, d_src = _split(
                dev, [num_tokens, num_tokens, num_tokens, len(scored), rows, len(query_start), rows * width,
                      len(pending_dst), len(pending_src)])
        if self.device.type == "cpu":
            d_pos = d_pos.long()  # the CPU RoPE kernel indexes its tables with int64
        meta = self._metadata(order, num_decodes, seq_lens, block_lists, starts, nums, q_starts, d_slots,
                              d_lens, d_tables.view(rows, width),
                              None if graph is not None else d_qstart, int(nums[num_decodes:].max(initial=0)))
        inputs = StepInputs(d_ids, d_pos, meta, order, logits_rows, d_scored, drafts, prompt_rows,
                            graph.batch if graph is not None else None, dev)
        if pending_dst:
            inputs.pending_dst, inputs.pending_src = d_dst, d_src
        return inputs

    def _metadata(self, order: list[str], num_decodes: int, seq_lens: np.ndarray, block_lists: list[list[int]],
                  starts: np.ndarray, nums: np.ndarray, q_starts: np.ndarray, slots: torch.Tensor,
                  d_lens: torch.Tensor, d_tables: torch.Tensor, d_qstart: torch.Tensor | None,
                  max_query_len: int) -> AttentionMetadata:
        # Host lists for the torch path and the CPU kernel (padding rows included for graphs).
        decode_lens = seq_lens[:num_decodes].tolist()
        prefills = [PrefillSeq(int(q_starts[i]), int(nums[i]), int(starts[i] + nums[i]), block_lists[i])
                    for i in range(num_decodes, len(order))]
        gpu = None
        if self.kernel_tables:
            max_ctx = max(decode_lens, default=1)
            gpu = KernelTables(
                decode_block_tables=d_tables[:num_decodes] if num_decodes else None,
                decode_seq_lens=d_lens[:num_decodes] if num_decodes else None,
                num_splits=self.num_splits(num_decodes, max_ctx) if num_decodes else 1,
                prefill_block_tables=d_tables[num_decodes:] if prefills else None,
                prefill_seq_lens=d_lens[num_decodes:] if prefills else None,
                prefill_query_start=d_qstart if prefills else None,
                prefill_max_query_len=max_query_len)
        return AttentionMetadata(
            slot_mapping=slots,
            num_decodes=num_decodes,
            decode_block_tables=block_lists[:num_decodes] or None,
            decode_seq_lens=decode_lens or None,
            prefills=prefills,
            block_size=self.block_size,
            gpu=gpu,
        )


def _split(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    views, offset = [], 0
    for size in sizes:
        views.append(flat[offset:offset + size])
        offset += size
    return views

