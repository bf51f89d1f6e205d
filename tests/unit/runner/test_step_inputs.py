"""InputBuilder: a step's packed tensors, checked value by value (block size 4)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.workers.core.request import PENDING_TOKEN, SamplingParams
from tandem.workers.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.workers.runner.block_table import BlockTable
from tandem.workers.runner.graph_inputs import GraphTarget, MixedTarget, mixed_layout
from tandem.workers.runner.graph_steps import scored_rows
from tandem.workers.runner.step_inputs import InputBuilder

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SCRATCH = 50


@dataclass
class State:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=lambda: GREEDY)
    row: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def _step() -> tuple[SchedulerOutput, dict[str, State], BlockTable]:
    """a: decoding at position 9 (its token still on the device); b: a new 6-token prompt with
    4 cached; c: decoding at position 5; d: the first 3 tokens of a 7-token prompt."""
    states = {
        "a": State(list(range(100, 109)), [PENDING_TOKEN], [7, 8, 9]),
        "b": State([1, 2, 3, 4, 5, 6], [], [20, 21]),
        "c": State([30, 31, 32, 33, 34], [35], [11, 12]),
        "d": State([40, 41, 42, 43, 44, 45, 46], [], [3, 4]),
    }
    table = BlockTable(8)
    for state in states.values():
        state.row = table.add(state.block_ids)
    out = SchedulerOutput(step_id=0)
    out.num_scheduled_tokens = {"b": 2, "a": 1, "d": 3, "c": 1}
    out.new_requests = [NewRequestData("b", [], [], GREEDY, [], 4), NewRequestData("d", [], [], GREEDY, [], 0)]
    out.cached_requests = [CachedRequestData("a", [], [], 9, 3), CachedRequestData("c", [], [], 5, 2)]
    return out, states, table


def _builder(kernel_tables: bool, host_lists: bool = True) -> InputBuilder:
    return InputBuilder(4, torch.device("cpu"), SCRATCH, kernel_tables, lambda batch, context: 3, host_lists)


def test_mixed_step_packs_decodes_first() -> None:
    out, states, table = _step()
    inputs = _builder(kernel_tables=False).build(out, states, table, pending_source={"a": 5})
    assert inputs.req_ids == ["a", "c", "b", "d"]
    assert inputs.input_ids.tolist() == [PENDING_TOKEN, 35, 5, 6, 40, 41, 42]
    assert inputs.positions.tolist() == [9, 5, 4, 5, 0, 1, 2]
    # block_ids[p // 4] * 4 + p % 4
    assert inputs.meta.slot_mapping.tolist() == [37, 49, 84, 85, 12, 13, 14]
    assert inputs.logits_rows == [[0], [1], [3], []]  # d's chunk stops short of its prompt's end
    assert inputs.logits_index.tolist() == [0, 1, 3]
    assert inputs.drafts == [[], [], [], []]
    assert inputs.pending_dst.tolist() == [0] and inputs.pending_src.tolist() == [5]
    meta = inputs.meta
    assert meta.num_decodes == 2
    assert meta.decode_seq_lens == [10, 6]
    assert meta.decode_block_tables == [[7, 8, 9], [11, 12]]
    assert [(p.q_start, p.q_len, p.ctx_len, p.block_ids) for p in meta.prefills] == [(2, 2, 6, [20, 21]),
                                                                                    (4, 3, 3, [3])]
    assert meta.gpu is None


def test_kernel_tables_without_host_lists() -> None:
    out, states, table = _step()
    inputs = _builder(kernel_tables=True, host_lists=False).build(out, states, table, pending_source={"a": 5})
    meta = inputs.meta
    assert meta.decode_block_tables is None and meta.decode_seq_lens == [10, 6]
    gpu = meta.gpu
    assert gpu.decode_block_tables.tolist() == [[7, 8, 9], [11, 12, 0]]
    assert gpu.decode_seq_lens.tolist() == [10, 6]
    assert gpu.num_splits == 3
    assert gpu.prefill_block_tables.tolist() == [[20, 21, 0], [3, 4, 0]]
    assert gpu.prefill_seq_lens.tolist() == [6, 3]
    assert gpu.prefill_query_start.tolist() == [0, 2, 5]
    assert gpu.prefill_max_query_len == 3


def test_decode_step_padded_to_its_graph_bucket() -> None:
    out, states, table = _step()
    out.num_scheduled_tokens = {"a": 1, "c": 1}
    out.new_requests = []
    buffer = torch.full((64,), -1, dtype=torch.int32)
    graph = GraphTarget(batch=4, width=3, buffer=buffer, num_splits=7)
    inputs = _builder(kernel_tables=True, host_lists=True).build(out, states, table, graph, {"a": 1})
    assert inputs.graph_batch == 4
    assert inputs.input_ids.tolist() == [PENDING_TOKEN, 35, 0, 0]
    assert inputs.positions.tolist() == [9, 5, 0, 0]
    assert inputs.meta.slot_mapping.tolist() == [37, 49, 200, 200]  # padding rows: the scratch block
    meta = inputs.meta
    assert meta.num_decodes == 4 and meta.decode_seq_lens == [10, 6, 1, 1]
    assert meta.decode_block_tables == [[7, 8, 9], [11, 12], [SCRATCH], [SCRATCH]]
    assert meta.gpu.decode_block_tables.tolist() == [[7, 8, 9], [11, 12, 0], [SCRATCH, 0, 0], [SCRATCH, 0, 0]]
    assert meta.gpu.num_splits == 7  # the bucket's, as captured
    assert inputs.pending_dst.tolist() == [0] and inputs.pending_src.tolist() == [1]
    # Everything landed in the graph's own buffer: ids, positions, slots, lengths, tables, pending.
    assert buffer[:16].tolist() == [PENDING_TOKEN, 35, 0, 0, 9, 5, 0, 0, 37, 49, 200, 200, 10, 6, 1, 1]
    assert buffer[28:30].tolist() == [0, 1]


def test_graph_step_carries_its_scored_rows_when_a_chunk_before_them_scores_nothing() -> None:
    """d's 1-token chunk (not its prompt's last token) comes before c's decode: c's row 1 is the
    only one scored, and its index travels in the graph's buffer after the pending indices."""
    out, states, table = _step()
    out.num_scheduled_tokens = {"d": 1, "c": 1}
    out.new_requests = [NewRequestData("d", [], [], GREEDY, [], 0)]
    out.cached_requests = [CachedRequestData("c", [], [], 5, 2)]
    buffer = torch.full((64,), -1, dtype=torch.int32)
    graph = GraphTarget(batch=4, width=3, buffer=buffer, num_splits=7)
    inputs = _builder(kernel_tables=True).build(out, states, table, graph)
    assert inputs.req_ids == ["d", "c"] and inputs.logits_rows == [[], [1]]
    assert inputs.logits_index.tolist() == [1]
    assert buffer[28].item() == 1  # after 4 x 4 rows and 4 x 3 table entries, no pending
    logits = torch.arange(4 * 5, dtype=torch.float32).view(4, 5)
    assert scored_rows(logits, inputs).tolist() == [[5.0, 6.0, 7.0, 8.0, 9.0]]
    # In order from the first row, nothing travels: the scored rows are a prefix of the logits.
    out.num_scheduled_tokens = {"c": 1, "d": 1}
    inputs = _builder(kernel_tables=True).build(out, states, table, graph)
    assert inputs.logits_rows == [[0], []] and inputs.logits_index.numel() == 0
    assert scored_rows(logits, inputs).tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0]]


def test_mixed_step_padded_to_its_graph_bucket() -> None:
    # a, c decoding; b, d prompt chunks: 7 tokens padded to a bucket of 8 tokens, 3 decode rows
    # and 3 prefill sequences, tables 3 wide. Stale values (-9) must not survive where the
    # graph reads them.
    out, states, table = _step()
    sizes = mixed_layout(8, 3, 3, 3)
    assert sizes == [8, 8, 8, 6, 3, 3, 4, 9, 3, 3, 9]
    buffer = torch.full((sum(sizes),), -9, dtype=torch.int32)
    target = MixedTarget(tokens=8, decodes=3, prefills=3, width=3, buffer=buffer, num_splits=5)
    inputs = _builder(kernel_tables=True, host_lists=False).build(out, states, table, target, {"a": 5})
    assert (inputs.graph_tokens, inputs.graph_batch) == (8, None)
    assert inputs.req_ids == ["a", "c", "b", "d"]
    assert inputs.input_ids.tolist() == [PENDING_TOKEN, 35, 5, 6, 40, 41, 42, 0]
    assert inputs.positions.tolist() == [9, 5, 4, 5, 0, 1, 2, 0]
    assert inputs.meta.slot_mapping.tolist() == [37, 49, 84, 85, 12, 13, 14, -1]  # padding writes no KV
    assert inputs.logits_rows == [[0], [1], [3], []]
    assert inputs.logits_index.tolist() == [0, 1, 3, 0, 0, 0]  # the scored rows first, then padding
    assert inputs.pending_dst.tolist() == [0] and inputs.pending_src.tolist() == [5]
    meta = inputs.meta
    assert meta.num_decodes == 2 and meta.decode_seq_lens == [10, 6]
    assert [(p.q_start, p.q_len, p.ctx_len) for p in meta.prefills] == [(2, 2, 6), (4, 3, 3)]
    gpu = meta.gpu
    assert gpu.fixed_layout and gpu.num_splits == 5 and gpu.prefill_max_query_len == 8
    assert gpu.decode_seq_lens.tolist() == [10, 6, 0]  # the padding row attends to nothing
    assert gpu.decode_block_tables[:2].tolist() == [[7, 8, 9], [11, 12, 0]]
    assert gpu.decode_block_tables[2].tolist() == [-9, -9, -9]  # never read (length 0), never copied
    assert gpu.prefill_seq_lens.tolist() == [6, 3, 0]
    assert gpu.prefill_query_start.tolist() == [2, 4, 7, 7]  # among all the step's tokens; padding: empty
    assert gpu.prefill_block_tables.tolist() == [[20, 21, 0], [3, 4, 0], [0, 0, 0]]
