"""The figures a group's engine reports: each request's timeline and counts, the group's
counters for the server's metrics exporter, and the model's cost that prices its steps.

A request's figures (`RequestMetrics`, on its last output) are mostly on its state
(text/output_processor.py); the scheduling ones (first scheduled, prefill chunks,
preemptions) are on its first sequence, which the scheduler lets go of when it finishes,
so they are copied onto the state before that.
"""

from __future__ import annotations

from tandem.workers.core.request import Request
from tandem.workers.core.scheduler import Scheduler
from tandem.workers.core.stats import EngineStats, RequestMetrics
from tandem.workers.engine.prompts import sequence_id
from tandem.workers.model.cost import ModelCost
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.spec.policy import SpeculationPolicy
from tandem.workers.text.output_processor import RequestState


def request_metrics(state: RequestState, scheduler: Scheduler) -> RequestMetrics:
    """The request's timeline and counts (finished_time is set by the caller)."""
    leader = scheduler.requests.get(sequence_id(state.request_id, state.params.n, 0))
    if leader is not None:  # still scheduled (an abort, a failure): its figures are current
        keep_leader_figures(state, leader)
    return RequestMetrics(
        arrival_time=state.arrival_time, first_scheduled_time=state.first_scheduled_time,
        first_token_time=state.first_token_time, last_token_time=state.last_token_time, finished_time=0.0,
        finish_reason=state.seqs[0].finish_reason or "abort", num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=sum(len(s.token_ids) for s in state.seqs),
        num_cached_tokens=state.num_cached_tokens, num_prefill_chunks=state.num_prefill_chunks,
        num_preemptions=state.num_preemptions, num_draft_tokens=state.num_draft_tokens,
        num_accepted_tokens=state.num_accepted_tokens)


def keep_leader_figures(state: RequestState, leader: Request) -> None:
    """The first sequence's scheduling figures, kept on the request once the scheduler lets go."""
    state.first_scheduled_time = leader.first_scheduled_time
    state.num_prefill_chunks = leader.num_prefill_chunks
    state.num_preemptions = leader.num_preemptions


def exporter_figures(scheduler: Scheduler, counters: EngineStats, spec: SpeculationPolicy) -> dict[str, float]:
    """Cumulative counters and current gauges for the server's metrics exporter.

    Read from another thread (the server's event loop) without stopping the engine: each
    figure is one read of a number the engine thread replaces, so it may be a step old,
    never torn."""
    return {
        **scheduler.metrics_snapshot(),
        **{f"num_finished_{reason}": n for reason, n in list(counters.num_finished.items())},
        "num_steps": counters.num_steps, "step_seconds": counters.step_seconds,
        "bytes_read": counters.bytes_read, "flops": counters.flops,
        "spec_num_draft_tokens": spec.stats.num_draft_tokens,
        "spec_num_accepted_tokens": spec.stats.num_accepted_tokens,
        "spec_switched_off": float(spec.switched_off),
    }


def model_cost(hf_config: HFModelConfig, dtype_option: str, device_type: str) -> ModelCost:
    """What the whole model's forward pass costs (FLOPs, bytes), in the dtype it runs in on `device_type`."""
    import torch

    # A simulated device stands for a GPU: the model's dtype as it would run there.
    dtype = hf_config.resolve_dtype(dtype_option, torch.device("cuda" if device_type == "sim" else device_type))
    return ModelCost.from_hf_config(hf_config, itemsize=dtype.itemsize)
