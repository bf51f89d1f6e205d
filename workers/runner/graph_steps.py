"""Steps that run in the CUDA graphs, from the runner's side: which bucket a step pads to, and
its scored rows' logits once the bucket's graph has run.

A pure decode step (one token per request) pads to a decode bucket (cuda_graphs.py), a step with
prompt chunks beside its decodes to a mixed bucket (mixed_graphs.py); any other step runs eagerly.
"""

from __future__ import annotations

import torch

from tandem.workers.core.scheduler_output import SchedulerOutput
from tandem.workers.runner.cuda_graphs import DecodeGraphs
from tandem.workers.runner.graph_inputs import GraphTarget, MixedTarget
from tandem.workers.runner.mixed_graphs import MixedGraphs
from tandem.workers.runner.request_state import CachedRequestState
from tandem.workers.runner.step_inputs import StepInputs


def graph_target(graphs: DecodeGraphs | None, mixed_graphs: MixedGraphs | None, out: SchedulerOutput,
                 states: dict[str, CachedRequestState]) -> GraphTarget | MixedTarget | None:
    """A step a graph bucket holds (on every pipeline stage alike): a pure decode step (one token
    per request) in a decode bucket, a mixed step in a mixed one. Neither with drafts, nor with
    a prompt position to score for prompt logprobs (those need the hidden states), nor with a
    context past the graphs' block tables."""
    sched = out.num_scheduled_tokens
    if graphs is None or out.spec_token_ids or len(sched) > graphs.max_batch:
        return None
    pure_decode = out.total_num_scheduled_tokens == len(sched)
    if not pure_decode and mixed_graphs is None:
        return None
    capture_len = graphs.max_context
    for group in (out.cached_requests, out.new_requests):
        for r in group:
            if r.num_computed_tokens + sched[r.req_id] > capture_len:
                return None  # a context past the graphs' block tables: eager
            state = states[r.req_id]
            if state.sampling_params.prompt_logprobs is not None \
                    and r.num_computed_tokens < len(state.prompt_token_ids) - 1:
                return None  # a prompt chunk whose logits score the next prompt tokens
    if pure_decode:
        return graphs.target(len(sched))
    num_prefills = sum(1 for n in sched.values() if n != 1)
    return mixed_graphs.target(out.total_num_scheduled_tokens, num_prefills)


def graph_logits(graphs: DecodeGraphs, mixed_graphs: MixedGraphs | None, inputs: StepInputs,
                 hidden: torch.Tensor | None = None) -> torch.Tensor | None:
    """A graph step's logits at its scored rows (None if it scores none). `hidden`: the previous
    pipeline stage's rows, on the last stage of several (decode graphs only)."""
    if inputs.graph_tokens is not None:  # the scored rows come first, in order
        logits = mixed_graphs.run(inputs)  # run even if it scores none: it writes the chunks' KV
        num_scored = inputs.num_scored
        return logits[:num_scored] if num_scored else None
    return scored_rows(graphs.run(inputs, hidden), inputs)


def scored_rows(logits: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
    """A decode graph step's scored rows: its first rows in order, or the rows its inputs
    carry (`logits_index`) where a 1-token prefill chunk before them scores nothing."""
    if inputs.logits_index.numel():
        return logits.index_select(0, inputs.logits_index)
    num_scored = inputs.num_scored
    return logits[:num_scored] if num_scored else None
