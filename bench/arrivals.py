"""Decoding under a stream of arrivals: the steps that admit a prompt beside running decodes.

B requests decode together while a new request arrives every few steps; its prompt comes in
one step beside the decodes (a mixed step), as on a server under steady traffic. The figure
is the time per step over the whole run, measured with the mixed-step CUDA graphs
(`workers/runner/mixed_graphs.py`) and without them (the runner's mixed graphs set aside for
that run, so those steps run eagerly), interleaved, the median of repeats. Both runs
schedule the same steps.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tandem.bench.report import Figures
from tandem.bench.tandem_runs import next_run_ids
from tandem.bench.workload import BenchRequest, fixed_length_requests
from tandem.workers.core.request import SamplingParams
from tandem.workers.device_peaks import sync

# 32 decoding requests; a 192-token prompt arrives every 4 steps (then decodes 4 tokens).
DECODERS, DECODER_PROMPT, DECODER_OUTPUT = 32, 64, 96
ARRIVALS, ARRIVAL_PROMPT, ARRIVAL_OUTPUT, EVERY = 24, 192, 4, 4
FIGURES = ("arrivals_step_ms", "arrivals_step_ms_eager_mixed", "arrivals_mixed_graph_speedup", "arrivals_steps")


def arrival_run(llm: Any, decoders: list[BenchRequest], arrivals: list[BenchRequest], every: int,
                temperature: float = 0.0) -> tuple[float, int]:
    """(seconds, engine steps) of one run: `decoders` submitted together, then one of `arrivals`
    before every `every`-th step, until every request has all its tokens."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "the engine must be idle"
    engine.pool.reset_prefix_cache()
    ids = next_run_ids(len(decoders) + len(arrivals))

    def add(request_id: str, req: BenchRequest) -> None:
        params = SamplingParams(temperature=temperature, max_tokens=req.output_len, ignore_eos=True,
                                output_kind="final")
        engine.add_request(request_id, {"prompt_token_ids": req.prompt_token_ids}, params)

    sync(llm.engine.executor.runner.device)
    start = time.perf_counter()
    for request_id, req in zip(ids, decoders):
        add(request_id, req)
    waiting = list(zip(ids[len(decoders):], arrivals))
    steps = 0
    while engine.has_unfinished_requests() or waiting:
        if waiting and steps % every == 0:
            add(*waiting.pop(0))
        engine.step()
        steps += 1
    sync(llm.engine.executor.runner.device)
    return time.perf_counter() - start, steps


def arrival_figures(llm: Any, vocab: int, repeats: int, temperature: float = 0.0) -> Figures:
    """Time per step with and without the mixed-step graphs (null where the runner has none:
    CPU, `enforce_eager`, `mixed_step_graphs=False`)."""
    runner = llm.engine.executor.runner
    graphs = runner.mixed_graphs
    if graphs is None or not graphs.graphs:
        return dict.fromkeys(FIGURES)
    decoders = fixed_length_requests(DECODERS, DECODER_PROMPT, DECODER_OUTPUT, vocab, seed=3)
    arrivals = fixed_length_requests(ARRIVALS, ARRIVAL_PROMPT, ARRIVAL_OUTPUT, vocab, seed=4)
    times: dict[bool, list[float]] = {True: [], False: []}
    steps = set()
    try:
        for rep in range(repeats + 1):  # the first round warms both up, untimed
            for with_graphs in ((True, False) if rep % 2 == 0 else (False, True)):
                runner.mixed_graphs = graphs if with_graphs else None
                seconds, num_steps = arrival_run(llm, decoders, arrivals, EVERY, temperature)
                if rep:
                    times[with_graphs].append(seconds / num_steps)
                    steps.add(num_steps)
    finally:
        runner.mixed_graphs = graphs
    assert len(steps) == 1, f"the two runs scheduled different steps: {sorted(steps)}"
    with_graphs, eager = (statistics.median(times[k]) for k in (True, False))
    return dict(zip(FIGURES, (with_graphs * 1e3, eager * 1e3, eager / with_graphs, steps.pop()), strict=True))
