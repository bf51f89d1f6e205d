"""`tandem bench offline --pipeline-parallel-size P`'s `pp_inflight_speedup`: the offline set's
throughput with P steps in flight (`pipeline_inflight_batches` P, the default: each stage busy
across steps) over one step at a time (1: each step split into a micro-batch a stage).

The two engines run one after the other, each loaded for its run and shut down after it (a
small machine holds one PP group's workers at a time), in an order rotated per repeat; the
speedup is the ratio of the medians.
"""

from __future__ import annotations

import statistics
from typing import Any

from tandem.bench.report import Figures
from tandem.bench.tandem_runs import run_tandem
from tandem.bench.workload import BenchRequest


def pp_inflight_figures(options: dict[str, Any], requests: list[BenchRequest], warmup: list[BenchRequest],
                        repeats: int, guard: Any = None) -> Figures:
    """`pp_inflight_tok_s_1`, `pp_inflight_tok_s_{P}` (output tok/s, medians) and the speedup.
    `guard(fn)` runs a timed run (the contention log's redo), where given."""
    from tandem.workers.llm import LLM

    pp = options["pipeline_parallel_size"]
    runs: dict[int, list[float]] = {1: [], pp: []}
    depths = [1, pp]
    for rep in range(repeats):
        for depth in depths[rep % 2:] + depths[:rep % 2]:
            llm = LLM(**{**options, "pipeline_inflight_batches": depth})
            try:
                run_tandem(llm, warmup, desc="warm-up", show_progress=False)

                def timed(llm: Any = llm) -> float:
                    return run_tandem(llm, requests, desc="timed", show_progress=False).tokens_per_s

                runs[depth].append(guard(timed) if guard is not None else timed())
            finally:
                llm.shutdown()
    one, many = statistics.median(runs[1]), statistics.median(runs[pp])
    return {"pp_inflight_tok_s_1": one, f"pp_inflight_tok_s_{pp}": many, "pp_inflight_speedup": many / one,
            "pp_inflight_repeats": repeats}
