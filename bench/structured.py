"""`tandem bench structured`: what a JSON schema enforced while decoding costs per output token.

Batch 1 and batch 32 (quick: 8), each run twice per repeat, with the schema and without, the
order alternating; a figure is the median over repeats of the per-repeat ratio
(`structured_tpot_ratio_b1`, `structured_tpot_ratio_b32`: time per decode token with the
schema over without). The schema is an array of objects (an integer, a bounded string, an
enum, a nested array of numbers) with a `minItems` no run reaches, so every request runs to
its exact length with and without it and the two runs decode the same number of tokens: what
differs is the grammar's work (the host fills each grammar row's mask and advances its
matcher; the sampling rank masks the logits) and that grammar rows are sampled on the host.
`compile_ms`: the schema's first compile for the model's tokenizer (after the tokenizer's
vocabulary is read, once per group).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from tqdm.auto import tqdm

from tandem.bench.tandem_runs import run_tandem
from tandem.bench.workload import fixed_length_requests

SCHEMA = {
    "type": "array", "minItems": 100000,  # never complete: every request runs to max_tokens
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "scores"],
              "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                             "kind": {"enum": ["user", "admin", "guest"]},
                             "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4}}},
}


def run_structured_bench(model: str | None, quick: bool, repeats: int | None = None, progress: bool = True,
                         engine_options: dict[str, Any] | None = None, idle_wait_s: float = 0.0) -> dict[str, Any]:
    from tandem.bench.hardware import wait_for_idle
    from tandem.workers.llm import LLM
    from tandem.workers.model.demo_model import bench_model_path
    from tandem.workers.structured.spec import StructuredSpec

    model = model or bench_model_path()
    repeats = repeats or (3 if quick else 5)
    big = 8 if quick else 32
    prompt_len, output_len = (16, 24) if quick else (32, 64)
    llm = LLM(model, **(engine_options or {}))
    vocab = llm.engine.hf_config.vocab_size
    spec = StructuredSpec.json_schema(SCHEMA)
    compiler = llm.engine.grammars.compiler  # made once per group: reads the tokenizer's vocabulary
    start = time.perf_counter()
    compiler.compile(spec)
    compile_ms = (time.perf_counter() - start) * 1e3
    batches = {1: fixed_length_requests(1, prompt_len, output_len, vocab, seed=1),
               big: fixed_length_requests(big, prompt_len, output_len, vocab, seed=2)}
    for requests in batches.values():  # warm-up: allocations, kernels, the matchers' first masks
        for structured in (None, spec):
            run_tandem(llm, requests, show_progress=False, structured=structured)
    waited = wait_for_idle(idle_wait_s) if idle_wait_s > 0 else 0.0
    load_start = os.getloadavg()[0]
    tpot: dict[tuple[int, bool], list[float]] = {(b, s): [] for b in batches for s in (False, True)}
    bar = tqdm(total=repeats * len(batches), desc="bench structured", disable=not progress)
    for rep in range(repeats):
        for batch, requests in batches.items():
            for structured in ((False, True) if rep % 2 == 0 else (True, False)):
                run = run_tandem(llm, requests, show_progress=False, structured=spec if structured else None)
                tpot[batch, structured].append(run.time_per_decode_token_s)
            bar.update(1)
    bar.close()
    llm.shutdown()
    figures: dict[str, Any] = {"benchmark": "structured", "model": model, "schema": json.dumps(SCHEMA),
                               "repeats": repeats, "output_len": output_len, "compile_ms": compile_ms,
                               "idle_wait_s": waited, "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0]}
    for batch in batches:
        name = "b1" if batch == 1 else f"b{batch}"
        plain, constrained = tpot[batch, False], tpot[batch, True]
        figures[f"tpot_plain_{name}_ms"] = statistics.median(plain) * 1e3
        figures[f"tpot_structured_{name}_ms"] = statistics.median(constrained) * 1e3
        figures[f"structured_tpot_ratio_{name}"] = statistics.median(c / p for c, p in zip(constrained, plain))
        figures[f"structured_tpot_ratio_{name}_repeats"] = [c / p for c, p in zip(constrained, plain)]
    figures["structured_batch"] = big
    return figures


def table_rows(fig: dict[str, Any]) -> list[tuple[str, Any, str]]:
    names = [name for name in fig if name.startswith(("tpot_", "structured_tpot_ratio_")) and
             not name.endswith("_repeats")]
    return [("compile_ms", fig["compile_ms"], "ms"), *((name, fig[name], "ms" if name.endswith("_ms") else "")
                                                       for name in names)]
