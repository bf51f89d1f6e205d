"""Driving tandem's engine for a benchmark, and timing its bare forward pass.

`run_tandem` feeds a request set to `GroupEngine` and steps it to the end, timing every
`engine.step()`: that is everything a user pays per step (scheduling, input tensors,
forward, logits, sampling, detokenisation and output building).

Engine overhead compares that step time with the model alone on the very same inputs: while
the engine runs, the `StepInputs` its runner prepared for each pure-decode step are kept;
afterwards `time_bare_forward` replays them through the runner's bare forward (the model and
the scored rows' logits, a CUDA-graph replay for graph steps) and nothing else. Timing
`runner.execute` instead would leave the scheduler and output processing out of the
numerator, which is the overhead we want to see.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.bench.gc_pauses import GcPauses
from tandem.bench.workload import BenchRequest
from tandem.workers.core.request import SamplingParams
from tandem.workers.device_peaks import sync

_run_ids = itertools.count()


@dataclass
class TandemRun:
    elapsed_s: float
    num_output_tokens: int
    # The decode phase: from the end of the first step after which every request has a token to
    # the end of the run, and the tokens the longest request still needed then.
    decode_s: float = 0.0
    decode_tokens: int = 0
    decode_inputs: list[Any] = field(default_factory=list)  # StepInputs of pure-decode steps (if recorded)
    gc: GcPauses = field(default_factory=GcPauses)  # the collector's pauses during the run

    @property
    def time_per_decode_token_s(self) -> float:
        """Seconds per decode token of every request: the inter-token time a user sees.

        Timed over the whole phase, not per `engine.step()` call: with overlapped steps a call
        returns the previous step's tokens while its own step still runs, and with multi-step
        decoding a call can carry eight passes or none, so one call's time is not one step's work.
        """
        return self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


class _StepCapture:
    """Wraps the runner's prepare_inputs on this instance to see each step's inputs (a
    multi-step step's first pass)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner  # None: the model runs on Ray workers, whose inputs stay there
        self.last: Any = None

    def __enter__(self) -> _StepCapture:
        if self.runner is None:
            return self
        inner = self.runner.prepare_inputs

        def prepare_inputs(out: Any, *args: Any, **kwargs: Any) -> Any:
            self.last = inner(out, *args, **kwargs)
            return self.last

        self.runner.prepare_inputs = prepare_inputs
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            del self.runner.prepare_inputs  # back to the class's method


def next_run_ids(num: int) -> list[str]:
    """`num` request ids no earlier run of this process used."""
    run = next(_run_ids)
    return [f"bench{run}-{i}" for i in range(num)]


def run_tandem(llm: Any, requests: list[BenchRequest], *, desc: str = "tandem", record_inputs: bool = False,
               show_progress: bool = True, temperature: float = 0.0, structured: Any = None) -> TandemRun:
    """Run `requests` with ignore_eos to their exact output lengths: greedily, or sampled
    (unseeded) at `temperature`; `structured`: a StructuredSpec every request's output follows
    (one that no output of that length completes, so the lengths stay exact)."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "the engine must be idle"
    engine.pool.reset_prefix_cache()  # repeats of a request set must not hit each other's prefixes
    ids = next_run_ids(len(requests))
    produced = dict.fromkeys(ids, 0)
    bar = tqdm(total=sum(r.output_len for r in requests), desc=desc, unit="tok", leave=False,
               disable=not show_progress)
    result = TandemRun(0.0, 0)
    decode_start = None
    with _StepCapture(getattr(engine.executor, "runner", None)) as capture, result.gc:
        start = time.perf_counter()
        for request_id, req in zip(ids, requests):
            # As LLM.generate asks: one output per request, when it finishes.
            params = SamplingParams(temperature=temperature, max_tokens=req.output_len, ignore_eos=True,
                                    output_kind="final", structured=structured)
            engine.add_request(request_id, {"prompt_token_ids": req.prompt_token_ids}, params)
        while engine.has_unfinished_requests():
            capture.last = None
            outputs = engine.step()
            now = time.perf_counter()
            new = 0
            for out in outputs:
                num = len(out.outputs[0].token_ids)
                new += num - produced[out.request_id]
                produced[out.request_id] = num
            bar.update(new)
            if decode_start is None:
                known = [_known_tokens(engine, request_id, produced) for request_id in ids]
                if min(known) >= 1:
                    decode_start = now
                    result.decode_tokens = max(req.output_len - k for req, k in zip(requests, known))
            inputs = capture.last
            if inputs is not None and not inputs.meta.prefills and len(inputs.req_ids) == len(requests):
                if record_inputs:
                    if inputs.graph_batch is not None:  # the graphs' shared buffer: keep this step's copy
                        inputs.staged = inputs.staged.clone()
                    result.decode_inputs.append(inputs)
        end = time.perf_counter()
        result.elapsed_s = end - start
        result.decode_s = end - decode_start if decode_start is not None else 0.0
    bar.close()
    for request_id, req in zip(ids, requests):
        assert produced[request_id] == req.output_len, (
            f"{request_id}: {produced[request_id]} tokens, asked for {req.output_len}")
    result.num_output_tokens = sum(produced.values())
    return result


def _known_tokens(engine: Any, request_id: str, produced: dict[str, int]) -> int:
    """Output tokens of a request known on the host (a step scheduled ahead holds placeholders)."""
    req = engine.scheduler.requests.get(request_id)
    return produced[request_id] if req is None else len(req.output_token_ids) - req.num_pending


@torch.inference_mode()
def time_bare_forward(runner: Any, inputs: list[Any], device: torch.device) -> list[float]:
    """Seconds of the runner's bare forward (the model and the scored rows' logits; a graph
    replay for graph steps) on each recorded step's inputs.

    The per-step masks and kernel tables cached on the metadata are cleared first: building
    them is part of the forward pass the engine paid for. Replaying writes each step's K/V into
    the slots it wrote before (freed blocks by now), which changes nothing any request will read.
    A graph step's inputs are copied into the graphs' buffer again, as the engine does.
    """
    times = []
    for step in inputs:
        meta = step.meta
        meta.decode_groups_by_window.clear()
        meta.kernel_inputs = None  # the CPU kernel's block tables, built per step like the masks
        for seq in meta.prefills:
            seq.masks.clear()
            seq.block_index = None
        if step.graph_batch is not None:  # later steps overwrote the shared input buffer
            runner.graphs.buffer[:step.staged.numel()].copy_(step.staged)
        sync(device)
        start = time.perf_counter()
        runner.forward(step)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
