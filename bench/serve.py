"""`tandem bench serve`: load on an OpenAI-compatible server, measured the way users feel it.

Each request is a streaming `/v1/completions` call (token-id prompt, `ignore_eos`, a fixed
`max_tokens`; with `--no-stream` one answered whole, whose TTFT is its E2E) from a seeded
request set, one per level. At each load level, requests arrive as a Poisson
process at a given rate (`inf` = all at once) or are kept at a fixed number in flight, and
per request we record:

    TTFT  send -> first streamed chunk        ITL   gaps between chunks
    E2E   send -> end of stream               TPOT  (E2E - TTFT) / (output tokens - 1)

and, per level, p50/p90/p99 of each, request and token throughput, and goodput: requests per
second that met every SLO (TTFT and TPOT bounds, stated in the output).

With no `--url` it serves tandem itself (bench/server.py), and also runs the
offline engine on the same requests with the same number in flight:
`server_vs_offline_throughput` = server output tok/s / offline output tok/s (target >= 0.9).
There it also measures the served path (bench/serve_figures.py): `server_cpu_us_per_token`
over the compare level, `single_stream_itl_ratio` (with `simulated_step_ms`) and
`stall_itl_p99_ratio` (streaming; `stall_check` False leaves it out).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from collections import deque
from typing import Any

from tandem.bench import serve_figures
from tandem.bench.load_generator import LoadLevel, base_url, httpx, run_level, summarize
from tandem.bench.report import log_progress
from tandem.bench.server import SERVED_MODEL_NAME, AppBuilder, bench_server
from tandem.bench.workload import BenchRequest, WorkloadSpec, make_workload
from tandem.cluster.direct_ingress import default_proxy

SERVE_FULL = WorkloadSpec(num_requests=64, prompt_len=(32, 256), output_len=(32, 128), seed=0)
SERVE_QUICK = WorkloadSpec(num_requests=24, prompt_len=(16, 96), output_len=(16, 48), seed=0)
DEFAULT_RATES = {False: (1.0, 2.0, 4.0, math.inf), True: (2.0, math.inf)}  # by quick
DEFAULT_COMPARE_CONCURRENCY = {False: 16, True: 8}
DEFAULT_SLO_TTFT_MS = 2000.0  # CPU-sized; pass tighter ones for a GPU
DEFAULT_SLO_TPOT_MS = 200.0
URL_MODE_VOCAB_SIZE = 1000  # prompt ids are drawn below this when the server's model is unknown


def run_serve_bench(url: str | None, quick: bool, *, model: str | None = None, served_model: str | None = None,
                    engine_options: dict[str, Any] | None = None, serving_options: dict[str, Any] | None = None,
                    local_app: AppBuilder | None = None, request_rates: list[float] | None = None,
                    concurrencies: list[int] | None = None, compare_concurrency: int | None = None,
                    spec: WorkloadSpec | None = None, slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
                    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS, api_key: str | None = None,
                    vocab_size: int | None = None, stream: bool = True, stall_check: bool = True,
                    proxy: str | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Figures of every load level, as one flat dict. `stream` False: non-streaming requests
    (answered whole; TTFT is then E2E; no ITL, so no single-stream level or stall check).

    With `url`, load that server (`served_model`: the model name to send; default: the first of
    its /v1/models). With url None, serve tandem through `local_app` (`model`: a local
    directory, default the built-in benchmark model; `engine_options` go to the engine and the
    offline comparison, `serving_options` (num_replicas, ...) to the server only; `proxy`
    in front of its ingress, cluster/direct_ingress.py, None: HAProxy where installed) and
    compare with the offline engine.
    Level i sends the request set of seed `spec.seed + i`: the same shape at every level, and
    no level hits the prefix cache that an earlier one filled.
    """
    spec = spec or (SERVE_QUICK if quick else SERVE_FULL)
    if concurrencies:
        levels = [LoadLevel(concurrency=c) for c in concurrencies]
    else:
        levels = [LoadLevel(rate=r) for r in (request_rates or DEFAULT_RATES[quick])]
    figures: dict[str, Any] = {
        "num_requests": spec.num_requests, "prompt_len_min": spec.prompt_len[0], "prompt_len_max": spec.prompt_len[1],
        "output_len_min": spec.output_len[0], "output_len_max": spec.output_len[1], "workload_seed": spec.seed,
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "load_levels": ",".join(lv.key for lv in levels),
        "quick": quick, "stream": stream,
    }
    if url is not None:
        url = base_url(url)
        figures.update(url=url, model=served_model or _served_model(url, api_key) or "")
        vocab = vocab_size or URL_MODE_VOCAB_SIZE
        _run_levels(url, spec, vocab, levels, figures, figures["model"] or None, api_key, show_progress, stream)
        return figures
    if local_app is None:
        raise ValueError("serving tandem here needs local_app (router.serve_cli.local_app), or give a url")

    from tandem.workers.model.demo_model import bench_model_path
    from tandem.workers.model.hf_config import HFModelConfig

    model_dir = os.path.abspath(model or bench_model_path())
    options = dict(engine_options or {})
    address = options.pop("address", None)
    vocab = vocab_size or HFModelConfig.from_dir(model_dir).vocab_size
    compare = LoadLevel(concurrency=compare_concurrency or DEFAULT_COMPARE_CONCURRENCY[quick])
    server_levels = levels if compare in levels else levels + [compare]
    proxy = proxy or default_proxy()
    figures.update(model=model_dir, compare_concurrency=compare.concurrency, proxy=proxy if address is None else "")
    log_progress("serve", show_progress, f"offline engine, {compare.concurrency} in flight")
    compare_requests = level_requests(spec, vocab, server_levels.index(compare))
    figures["offline_output_tok_s"] = offline_throughput(model_dir, options, compare_requests, compare.concurrency)
    app_options = {**(serving_options or {}), **options, "model": model_dir}
    step_ms = serve_figures.simulated_step(options)
    with bench_server(local_app, {"": app_options}, num_cpus=(os.cpu_count() or 1) + 4, address=address,
                      proxy=proxy) as urls:
        figures.update(url=urls[""])
        # A joined cluster's processes are not this one's descendants: their CPU is not ours to
        # read. Without /proc (not Linux) there is nothing to read it from.
        cpu_key = compare.key if address is None and os.path.isdir("/proc") else None
        _run_levels(urls[""], spec, vocab, server_levels, figures, SERVED_MODEL_NAME, None, show_progress, stream,
                    cpu_key)
        extra = len(server_levels)  # request-set indices past the levels': no prefix-cache hits
        if stream and step_ms is not None:
            _single_stream(urls[""], spec, vocab, extra, step_ms, figures, show_progress)
        if stream and stall_check:
            _stall_check(urls[""], spec, vocab, extra + 1, figures, show_progress)
    figures["server_output_tok_s"] = figures[f"{compare.key}_output_tok_s"]
    figures["server_vs_offline_throughput"] = figures["server_output_tok_s"] / figures["offline_output_tok_s"]
    return figures


def level_requests(spec: WorkloadSpec, vocab_size: int, index: int) -> list[BenchRequest]:
    return make_workload(dataclasses.replace(spec, seed=spec.seed + index), vocab_size)


def _run_levels(url: str, spec: WorkloadSpec, vocab_size: int, levels: list[LoadLevel], figures: dict[str, Any],
                model: str | None, api_key: str | None, show_progress: bool, stream: bool = True,
                cpu_key: str | None = None) -> None:
    """Each level's figures into `figures`; around the level named `cpu_key`, the server's CPU too."""
    # Warm-up prompts are shorter than a KV block, so they leave nothing in the prefix cache.
    warmup = [BenchRequest(r.prompt_token_ids[:8], 4) for r in level_requests(spec, vocab_size, -1)[:2]]
    asyncio.run(run_level(url, warmup, LoadLevel(rate=math.inf), model=model, api_key=api_key, stream=stream))
    for i, level in enumerate(levels):
        log_progress("serve", show_progress, f"server at {level.key}: {spec.num_requests} requests")
        cpu_before = serve_figures.read_server_cpu() if level.key == cpu_key else None
        records, duration = asyncio.run(run_level(url, level_requests(spec, vocab_size, i), level, model=model,
                                                  api_key=api_key, seed=spec.seed + i, stream=stream))
        if cpu_before is not None:
            figures.update(serve_figures.server_cpu_figures(cpu_before, serve_figures.read_server_cpu(), records,
                                                            duration))
        figures.update(summarize(level.key, records, duration, figures["slo_ttft_ms"], figures["slo_tpot_ms"]))


def _single_stream(url: str, spec: WorkloadSpec, vocab_size: int, index: int, step_ms: tuple[float, float],
                   figures: dict[str, Any], show_progress: bool) -> None:
    """One request in flight at a time: `single_stream_*` and its ITL p50 over the simulated step."""
    few = dataclasses.replace(spec, num_requests=serve_figures.SINGLE_STREAM_REQUESTS)
    log_progress("serve", show_progress, f"single stream: {few.num_requests} requests, one at a time")
    records, duration = asyncio.run(run_level(url, level_requests(few, vocab_size, index), LoadLevel(concurrency=1),
                                              model=SERVED_MODEL_NAME))
    figures.update(summarize("single_stream", records, duration, figures["slo_ttft_ms"], figures["slo_tpot_ms"]))
    figures.update(simulated_step_base_ms=step_ms[0], simulated_step_per_seq_ms=step_ms[1],
                   single_stream_itl_ratio=serve_figures.single_stream_itl_ratio(serve_figures.itl_gaps(records),
                                                                                 step_ms))


def _stall_check(url: str, spec: WorkloadSpec, vocab_size: int, index: int, figures: dict[str, Any],
                 show_progress: bool) -> None:
    """`stall_*`: the streams of request sets `index` and `index + 1`, the second with the 8 MiB prompt."""
    many = dataclasses.replace(spec, num_requests=serve_figures.STALL_STREAMS)
    log_progress("serve", show_progress, f"stall check: {many.num_requests} streams, without and with an 8 MiB "
                 "text prompt")
    figures.update(serve_figures.run_stall_check(
        url, level_requests(many, vocab_size, index), level_requests(many, vocab_size, index + 1),
        model=SERVED_MODEL_NAME, slo_ttft_ms=figures["slo_ttft_ms"], slo_tpot_ms=figures["slo_tpot_ms"]))


def _served_model(url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        return response.json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 - any server: then requests go without a model name
        return None


def offline_throughput(model_dir: str, engine_options: dict[str, Any], requests: list[BenchRequest],
                       concurrency: int) -> float:
    """Output tok/s of the offline engine on `requests`, refilled to `concurrency` in flight after each step."""
    from tandem.workers.llm import LLM

    llm = LLM(model=model_dir, **engine_options)
    try:
        _offline_run(llm.engine, [BenchRequest(r.prompt_token_ids[:8], 4) for r in requests[:2]], concurrency)
        num_output, elapsed = _offline_run(llm.engine, requests, concurrency)
    finally:
        llm.shutdown()
    return num_output / elapsed


def _offline_run(engine: Any, requests: list[BenchRequest], concurrency: int) -> tuple[int, float]:
    from tandem.workers.core.request import SamplingParams

    engine.pool.reset_prefix_cache()  # as the server sees them: no request hits another's prefix
    pending = deque(enumerate(requests))
    in_flight: set[str] = set()
    num_output = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i, req = pending.popleft()
            request_id = f"serve-bench-{len(requests)}-{i}"
            engine.add_request(request_id, {"prompt_token_ids": req.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True))
            in_flight.add(request_id)
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                num_output += len(out.outputs[0].token_ids)
    return num_output, time.perf_counter() - start
