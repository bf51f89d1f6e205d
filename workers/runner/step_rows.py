"""A step's rows on the host: the per-token and per-request lists its input tensors are packed from.

They are gathered from the scheduler's output and each request's state on every step, so their
cost per request is kept to a few list appends: decode rows (one token each, the bulk of a step
at steady state) are gathered in plain Python, since numpy's fixed cost per call exceeds a decode
row's whole work; prefill chunks (many tokens each) get their positions and KV slots vectorised
with numpy. Decodes (exactly one new token) come first: they batch into one attention call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tandem.workers.core.request import PENDING_TOKEN, token_at, token_slice
from tandem.workers.core.scheduler_output import SchedulerOutput


class RequestView(Protocol):
    """What gathering a step's rows reads of a request's state in the runner."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    row: int  # its row of the BlockTable

    @property
    def num_tokens(self) -> int: ...


@dataclass
class StepRows:
    """A step's host lists: the decodes' entries first, then the prefill chunks' (decodes
    carrying drafts among them)."""

    order: list[str]  # request ids, in the order their tokens appear
    num_decodes: int
    input_ids: list[int]
    positions: list[int]  # the decodes' (the chunks' are vectorised: `slot_mapping`)
    slots: list[int]  # the decodes'
    seq_lens: list[int]  # the decodes'
    table_rows: list[int]  # every request's row of the BlockTable
    logits_rows: list[list[int]]  # per request: token indices to score ([] = partial prefill)
    decode_lists: list[list[int]]  # the decodes' block lists, where the builder keeps them on the host
    # Requests asking for prompt logprobs: (req_id, first prompt index scored, token rows, prompt tokens)
    prompt_rows: list[tuple[str, int, list[int], list[int]]]
    pending_dst: list[int]  # token indices holding PENDING_TOKEN
    pending_src: list[int]  # where their tokens are among the previous step's sampled ones
    drafts: list[list[int]]
    prefill_lists: list[list[int]] = field(default_factory=list)
    prefill_starts: list[int] = field(default_factory=list)
    prefill_nums: list[int] = field(default_factory=list)


def step_order(out: SchedulerOutput) -> tuple[list[str], int]:
    """The step's requests in the order their tokens go, and how many decodes lead them."""
    sched = out.num_scheduled_tokens
    if out.total_num_scheduled_tokens == len(sched):  # every row a single token (no drafts then)
        return list(sched), len(sched)
    # Decodes (exactly one new token) first: they batch into one attention call.
    order = sorted(sched, key=lambda r: sched[r] != 1)
    return order, sum(1 for r in order if sched[r] == 1)


def decode_rows(order: list[str], num_decodes: int, states: dict[str, RequestView], computed: dict[str, int],
                pending_source: dict[str, int] | None, block_size: int, host_lists: bool) -> StepRows:
    """The rows of the decodes (the first `num_decodes` of `order`), in plain Python; the block
    lists of their blocks so far too where `host_lists`."""
    bs = block_size
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
    return StepRows(order, num_decodes, input_ids, positions, slots, seq_lens, table_rows, logits_rows,
                    decode_lists, prompt_rows, pending_dst, pending_src, drafts)


def add_prefill_chunks(rows: StepRows, states: dict[str, RequestView], computed: dict[str, int],
                       sched: dict[str, int], spec: dict[str, list[int]], block_size: int) -> None:
    """The rows of the prefill chunks (and decodes carrying drafts) after the decodes'; their
    positions and KV slots come vectorised (`slot_mapping`)."""
    bs = block_size
    input_ids, logits_rows, drafts, table_rows = rows.input_ids, rows.logits_rows, rows.drafts, rows.table_rows
    prefill_lists, prefill_starts, prefill_nums = rows.prefill_lists, rows.prefill_starts, rows.prefill_nums
    for req_id in rows.order[rows.num_decodes:]:
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
            rows.prompt_rows.append((req_id, start + 1, list(range(q_start, q_start + last - start)),
                                     state.prompt_token_ids[start + 1:last + 1]))


def slot_mapping(rows: StepRows, tables: np.ndarray,
                 block_size: int) -> tuple[np.ndarray, list[int] | np.ndarray, list[int] | np.ndarray]:
    """(the prefill chunks' query_start, every token's position, every token's KV slot): the
    decodes' as gathered, the chunks' vectorised, their slots looked up in their block tables."""
    bs = block_size
    nums = np.asarray(rows.prefill_nums, dtype=np.int64)
    query_start = np.zeros(len(rows.prefill_nums) + 1, dtype=np.int32)
    np.cumsum(nums, out=query_start[1:])
    if not rows.prefill_nums:
        return query_start, rows.positions, rows.slots
    starts = np.asarray(rows.prefill_starts, dtype=np.int64)
    chunk_req = np.repeat(np.arange(rows.num_decodes, len(rows.order)), nums)
    chunk_pos = np.repeat(starts - query_start[:-1], nums) + np.arange(int(query_start[-1]))
    chunk_slots = tables[chunk_req, chunk_pos // bs].astype(np.int64) * bs + chunk_pos % bs
    positions = np.concatenate([np.asarray(rows.positions, dtype=np.int64), chunk_pos])
    slots = np.concatenate([np.asarray(rows.slots, dtype=np.int64), chunk_slots])
    return query_start, positions, slots


def logits_index(rows: StepRows) -> list[int]:
    """The token indices to score, every request's in order: the rows of the step's logits."""
    return [r for req_rows in rows.logits_rows for r in req_rows]
