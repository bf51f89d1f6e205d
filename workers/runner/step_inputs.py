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


@dataclass(frozen=True)
class GraphTarget:
    """Where a padded decode step goes: a bucket's rows, its table width, its input buffer."""

    batch: int
    width: int
    buffer: torch.Tensor  # int32 device buffer the captured graph reads, laid out as above
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
    """Scheduler output + per-request state -> StepInputs, with one host-to-device copy.

    Runs on the host for every step, so its cost per request is kept to a few list appends:
    decode rows (one token each, the bulk of a step at steady state) are built in plain
    Python, since numpy's fixed cost per call exceeds a decode row's whole work; prefill
    chunks (many tokens each) are vectorised with numpy.
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
        bs = self.block_size
        computed = {r.req_id: r.num_computed_tokens + advance for r in out.new_requests}
        computed.update({r.req_id: r.num_computed_tokens + advance for r in out.cached_requests})
        sched = out.num_scheduled_tokens
        spec = out.spec_token_ids
        if out.total_num_scheduled_tokens == len(sched):  # every row a single token (no drafts then)
            order = list(sched)
            num_decodes = len(order)
        else:  # decodes (exactly one new token) first: they batch into one attention call
            order = sorted(sched, key=lambda r: sched[r] != 1)
            num_decodes = sum(1 for r in order if sched[r] == 1)
        num_reqs = len(order)
        mixed = graph if isinstance(graph, MixedTarget) else None
        if mixed is not None:
            graph = None  # the decode-graph padding below is not this step's
        rows = graph.batch if graph is not None else num_reqs

        # Decode rows, in plain Python.
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        table_rows: list[int] = []
        logits_rows: list[list[int]] = []
        decode_lists: list[list[int]] = []
        prompt_rows: list[tuple[str, int, list[int], list[int]]] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        host_lists = self.host_lists
        for i, req_id in enumerate(order[:num_decodes]):
            state = states[req_id]
            start = computed[req_id]
            prompt, outputs = state.prompt_token_ids, state.output_token_ids
            num_prompt = len(prompt)
            token = token_at(prompt, outputs, start)
            if token == PENDING_TOKEN:  # scheduled ahead: the token is on the device
                pending_dst.append(i)
                pending_src.append(pending_source[req_id])
            input_ids.append(token)
            positions.append(start)
            slots.append(state.block_ids[start // bs] * bs + start % bs)
            seq_lens.append(start + 1)
            table_rows.append(state.row)
            # Reaches the last known token: sample (a 1-token prefill chunk short of it does not).
            logits_rows.append([i] if start + 1 >= num_prompt + len(outputs) else [])
            if host_lists:
                decode_lists.append(state.block_ids[:start // bs + 1])
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # Position p's logits score prompt token p + 1.
                prompt_rows.append((req_id, start + 1, [i], prompt[start + 1:start + 2]))
        drafts: list[list[int]] = [[] for _ in range(num_decodes)]

        # Prefill chunks (and decodes carrying drafts), vectorised.
        prefill_lists: list[list[int]] = []
        prefill_starts: list[int] = []
        prefill_nums: list[int] = []
        for req_id in order[num_decodes:]:
            state = states[req_id]
            start, num = computed[req_id], sched[req_id]
            draft = spec.get(req_id, []) if spec else []
            q_start = len(input_ids)
            input_ids.extend(token_slice(state.prompt_token_ids, state.output_token_ids, start,
                                         start + num - len(draft)))
            input_ids.extend(draft)
            # Reaches the last known token: sample (at each draft position too).
            logits_rows.append(list(range(q_start + num - 1 - len(draft), q_start + num))
                               if start + num - len(draft) >= state.num_tokens else [])
            drafts.append(list(draft))
            prefill_lists.append(state.block_ids[:(start + num + bs - 1) // bs])
            table_rows.append(state.row)
            prefill_starts.append(start)
            prefill_nums.append(num)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                last = min(start + num, num_prompt - 1)
                prompt_rows.append((req_id, start + 1, list(range(q_start, q_start + last - start)),
                                    state.prompt_token_ids[start + 1:last + 1]))

        all_ends = seq_lens + [s + n for s, n in zip(prefill_starts, prefill_nums)]
        if mixed is not None:
            width = mixed.width
        else:
            width = graph.width if graph is not None else -(-(max(all_ends) + passes_after) // bs)
        if graph is None:
            tables = block_table.rows(np.asarray(table_rows, dtype=np.int64), width)
        else:
            tables = np.zeros((rows, width), dtype=np.int32)
            tables[:num_reqs] = block_table.rows(np.asarray(table_rows, dtype=np.int64), width)
        nums = np.asarray(prefill_nums, dtype=np.int64)
        query_start = np.zeros(len(prefill_nums) + 1, dtype=np.int32)
        np.cumsum(nums, out=query_start[1:])
        if prefill_nums:
            starts = np.asarray(prefill_starts, dtype=np.int64)
            chunk_req = np.repeat(np.arange(num_decodes, num_reqs), nums)
            chunk_pos = np.repeat(starts - query_start[:-1], nums) + np.arange(int(query_start[-1]))
            chunk_slots = tables[chunk_req, chunk_pos // bs].astype(np.int64) * bs + chunk_pos % bs
            positions_np = np.concatenate([np.asarray(positions, dtype=np.int64), chunk_pos])
            slots_np = np.concatenate([np.asarray(slots, dtype=np.int64), chunk_slots])
        else:
            positions_np, slots_np = positions, slots
        num_tokens = len(input_ids)
        pending = pending_dst + pending_src
        prefills = [PrefillSeq(len(seq_lens) + int(q), n, s + n, blocks)
                    for q, n, s, blocks in zip(query_start[:-1], prefill_nums, prefill_starts, prefill_lists)]
        scored = [r for req_rows in logits_rows for r in req_rows]
        if mixed is not None:
            d_ids, d_pos, meta, d_scored, d_dst, d_src = self._mixed_inputs(
                mixed, input_ids, positions_np, slots_np, scored, seq_lens, all_ends[num_decodes:], query_start,
                tables, pending_dst, pending_src, decode_lists, prefills)
            inputs = StepInputs(d_ids, d_pos, meta, order, logits_rows, d_scored, drafts, prompt_rows,
                                staged=mixed.buffer, graph_tokens=mixed.tokens)
            if pending_dst:
                inputs.pending_dst, inputs.pending_src = d_dst, d_src
            return inputs
        if graph is not None:  # pad the decode batch to its bucket: rows read the scratch block only
            pad = rows - num_reqs
            tables[num_reqs:, 0] = self.scratch_block
            head = (input_ids + [0] * pad + positions + [0] * pad + slots + [self.scratch_block * bs] * pad
                    + seq_lens + [1] * pad)
            if host_lists:
                decode_lists += [[self.scratch_block]] * pad
            # A graph step scores its first rows in order (logits_index empty), unless a 1-token
            # prefill chunk that scores nothing comes before a row that does: then the scored
            # rows travel with the step's inputs, so picking them never copies from the host.
            picked = scored if scored and scored[-1] != len(scored) - 1 else []
            dev = self.staging.upload([np.asarray(head, dtype=np.int32), tables.reshape(-1),
                                       np.asarray(pending + picked, dtype=np.int32)], graph.buffer)
            d_ids, d_pos, d_slots, d_lens, d_tables, d_dst, d_src, d_scored = split_views(
                dev, [rows, rows, rows, rows, rows * width, len(pending_dst), len(pending_src), len(picked)])
            d_qstart = None
            decode_lens = seq_lens + [1] * pad
            num_decodes = rows
        else:
            dev = self.staging.upload([np.asarray(input_ids, dtype=np.int32), np.asarray(positions_np, dtype=np.int32),
                                       np.asarray(slots_np, dtype=np.int32),
                                       np.asarray(scored + all_ends, dtype=np.int32), query_start,
                                       tables.reshape(-1), np.asarray(pending, dtype=np.int32)])
            d_ids, d_pos, d_slots, d_scored, d_lens, d_qstart, d_tables, d_dst, d_src = split_views(
                dev, [num_tokens, num_tokens, num_tokens, len(scored), rows, len(query_start), rows * width,
                      len(pending_dst), len(pending_src)])
            decode_lens = seq_lens
        if self.device.type == "cpu" and not self.kernel_tables:
            d_pos = d_pos.long()  # the CPU RoPE kernel indexes its tables with int64 (Triton's takes the view)
        meta = self._metadata(num_decodes, decode_lens, decode_lists, prefills,
                              d_slots, d_lens, d_tables.view(rows, width), d_qstart, max(prefill_nums, default=0),
                              graph)
        inputs = StepInputs(d_ids, d_pos, meta, order, logits_rows, d_scored, drafts, prompt_rows,
                            graph_batch=graph.batch if graph is not None else None, staged=dev)
        if pending_dst:
            inputs.pending_dst, inputs.pending_src = d_dst, d_src
        return inputs

    def _mixed_inputs(self, target: MixedTarget, input_ids: list[int], positions, slots, scored: list[int],
                      decode_lens: list[int], prefill_ends: list[int], query_start: np.ndarray, tables: np.ndarray,
                      pending_dst: list[int], pending_src: list[int], decode_lists: list[list[int]],
                      prefills: list[PrefillSeq]):
        """A mixed step padded to `target`'s bucket, copied into its buffer (`mixed_layout`):
        (input_ids, positions, metadata, logits_index, pending dst, pending src), each the
        bucket's size. Padding tokens write no KV (slot -1), padding decode rows and prefill
        sequences have nothing to attend (length 0, empty queries at the end)."""
        t, d, p, w = target.tokens, target.decodes, target.prefills, target.width
        num_tokens, num_decodes, num_prefills = len(input_ids), len(decode_lens), len(prefill_ends)
        sizes = mixed_layout(t, d, p, w)
        image = np.zeros(sum(sizes[:-1]), dtype=np.int32)  # all but the decode tables, copied row by row
        h_ids, h_pos, h_slots, h_scored, h_lens, h_ends, h_qstart, h_tables, h_dst, h_src = split_views(
            image, sizes[:-1])
        h_ids[:num_tokens] = input_ids
        h_pos[:num_tokens] = positions
        h_slots[:] = -1
        h_slots[:num_tokens] = slots
        h_scored[:len(scored)] = scored
        h_lens[:num_decodes] = decode_lens
        h_ends[:num_prefills] = prefill_ends
        h_qstart[:] = num_tokens  # padding sequences: empty queries past the last token
        h_qstart[:num_prefills + 1] = query_start + num_decodes  # offsets among all the step's tokens
        h_tables.reshape(p, w)[:num_prefills] = tables[num_decodes:]
        h_dst[:len(pending_dst)] = pending_dst
        h_src[:len(pending_src)] = pending_src
        self.staging.upload([image, tables[:num_decodes].reshape(-1)], target.buffer)
        d_ids, d_pos, meta, d_scored, d_dst, d_src = mixed_step_views(
            target.buffer, target, self.block_size, decode_lens, decode_lists, prefills)
        return d_ids, d_pos, meta, d_scored, d_dst[:len(pending_dst)], d_src[:len(pending_src)]

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


def split_views(flat, sizes: list[int]) -> list:
    """`flat` (a tensor or a numpy array) cut into consecutive views of `sizes`."""
    views, offset = [], 0
    for size in sizes:
        views.append(flat[offset:offset + size])
        offset += size
    return views

