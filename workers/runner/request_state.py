"""Each request's state in the runner: its token ids, its block ids and its row of the block table.

The runner decides nothing about a request; it applies the scheduler's diffs to this state
(`apply_step_diffs`). A step scheduled ahead of the last step's tokens sends PENDING_TOKEN
placeholders for them; once that step's output reaches the host, `fill_placeholders` puts the
sampled tokens in their place.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.workers.core.request import PENDING_TOKEN, SamplingParams
from tandem.workers.core.scheduler_output import RunnerOutput, SchedulerOutput
from tandem.workers.runner.block_table import BlockTable


@dataclass
class CachedRequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    row: int = -1  # its row of the runner's BlockTable

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# request -> its state and where its placeholders begin among its output tokens
Placeholders = dict[str, tuple[CachedRequestState, int]]


def apply_step_diffs(states: dict[str, CachedRequestState], block_table: BlockTable,
                     out: SchedulerOutput) -> Placeholders:
    """Bring `states` and `block_table` up to date with a step's diffs: finished requests out,
    new ones in, running ones' new tokens and blocks. Returns the placeholders the step's
    tokens scheduled ahead left in the token lists."""
    for req_id in out.finished_req_ids:
        state = states.pop(req_id, None)
        if state is not None:
            block_table.remove(state.row)
    for new in out.new_requests:
        state = CachedRequestState(list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                                   list(new.block_ids))
        if new.req_id in states:  # resumed after preemption without a finish in between
            block_table.remove(states[new.req_id].row)
        state.row = block_table.add(state.block_ids)
        states[new.req_id] = state
    placeholders: Placeholders = {}
    for diff in out.cached_requests:
        state = states[diff.req_id]
        state.output_token_ids.extend(diff.new_token_ids)
        if diff.new_token_ids and diff.new_token_ids[-1] == PENDING_TOKEN:
            # Scheduled ahead: the last step's tokens (one a pass), known when its output is.
            start = len(state.output_token_ids) - diff.new_token_ids.count(PENDING_TOKEN)
            placeholders[diff.req_id] = (state, start)
        del state.block_ids[diff.num_kept_blocks:]
        state.block_ids.extend(diff.new_block_ids)
        block_table.update(state.row, diff.num_kept_blocks, diff.new_block_ids)
    return placeholders


def fill_placeholders(placeholders: Placeholders, output: RunnerOutput) -> None:
    """Put a step's sampled tokens in the placeholders a step scheduled ahead on it left in
    the runner's token lists (`placeholders`: request -> its state and where they begin)."""
    for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
        placed = placeholders.get(req_id)
        if placed is not None and tokens:
            state, start = placed
            state.output_token_ids[start:start + len(tokens)] = tokens
