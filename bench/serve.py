"""`tandem bench serve`: load on an OpenAI-compatible server, measured the way users feel it.

Each request is a streaming `/v1/completions` call (token-id prompt, `ignore_eos`, a fixed
`max_tokens`) from a seeded request set, one per level. At each load level, requests arrive as a Poisson
process at a given rate (`inf` = all at once) or are kept at a fixed number in flight, and
per request we record:

    TTFT  send -> first streamed chunk        ITL   gaps between chunks
    E2E   send -> end of stream               TPOT  (E2E - TTFT) / (output tokens - 1)

and, per level, p50/p90/p99 of each, request and token throughput, and goodput: requests per
second that met every SLO (TTFT and TPOT bounds, stated in the output).

With no `--url` it serves tandem itself (`build_app` on a local Ray), and also runs the
offline engine on the same requests with the same number in flight:
`server_vs_offline_throughput` = server output tok/s / offline output tok/s (target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tandem.bench.load_generator import LoadLevel, base_url, httpx, run_level, summarize
from tandem.bench.serve_report import plot_serve, print_serve_table
from tandem.bench.report import log_progress
from tandem.bench.workload import BenchRequest, WorkloadSpec, make_workload


SERVE_FULL = WorkloadSpec(num_requests=64, prompt_len=(32, 256), output_len=(32, 128), seed=0)
SERVE_QUICK = WorkloadSpec(num_requests=24, prompt_len=(16, 96), output_len=(16, 48), seed=0)
DEFAULT_RATES = {False: (1.0, 2.0, 4.0, math.inf), True: (2.0, math.inf)}  # by quick
DEFAULT_COMPARE_CONCURRENCY = {False: 16, True: 8}
DEFAULT_SLO_TTFT_MS = 2000.0  # CPU-sized; pass tighter ones for a GPU
DEFAULT_SLO_TPOT_MS = 200.0
URL_MODE_VOCAB_SIZE = 1000  # prompt ids are drawn below this when the server's model is unknown
def run_serve_bench(url: str | None, quick: bool, *, model: str | None = None, served_model: str | None = None,
                    engine_options: dict[str, Any] | None = None, request_rates: list[float] | None = None,
                    concurrencies: list[int] | None = None, compare_concurrency: int | None = None,
                    spec: WorkloadSpec | None = None, slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
                    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS, api_key: str | None = None,
                    vocab_size: int | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Figures of every load level, as one flat dict.

    With `url`, load that server (`served_model`: the model name to send; default: the first of
    its /v1/models). With url None, serve tandem (`model`: a local directory, default the
    built-in benchmark model, with `engine_options`) and compare with the offline engine.
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
        "quick": quick,
    }
    if url is not None:
        url = base_url(url)
        figures.update(url=url, model=served_model or _served_model(url, api_key) or "")
        vocab = vocab_size or URL_MODE_VOCAB_SIZE
        _run_levels(url, spec, vocab, levels, figures, figures["model"] or None, api_key, show_progress)
        return figures

    from tandem.workers.model.demo_model import bench_model_path
    from tandem.workers.model.hf_config import HFModelConfig

    model_dir = os.path.abspath(model or bench_model_path())
    options = dict(engine_options or {})
    vocab = vocab_size or HFModelConfig.from_dir(model_dir).vocab_size
    compare = LoadLevel(concurrency=compare_concurrency or DEFAULT_COMPARE_CONCURRENCY[quick])
    server_levels = levels if compare in levels else levels + [compare]
    figures.update(model=model_dir, compare_concurrency=compare.concurrency)
    log_progress("serve", show_progress, f"offline engine, {compare.concurrency} in flight")
    compare_requests = _level_requests(spec, vocab, server_levels.index(compare))
    figures["offline_output_tok_s"] = offline_throughput(model_dir, options, compare_requests, compare.concurrency)
    with local_server(model_dir, options) as (server_url, served_name):
        figures.update(url=server_url)
        _run_levels(server_url, spec, vocab, server_levels, figures, served_name, None, show_progress)
    figures["server_output_tok_s"] = figures[f"{compare.key}_output_tok_s"]
    figures["server_vs_offline_throughput"] = figures["server_output_tok_s"] / figures["offline_output_tok_s"]
    return figures


def _level_requests(spec: WorkloadSpec, vocab_size: int, index: int) -> list[BenchRequest]:
    return make_workload(dataclasses.replace(spec, seed=spec.seed + index), vocab_size)


def _run_levels(url: str, spec: WorkloadSpec, vocab_size: int, levels: list[LoadLevel], figures: dict[str, Any],
                model: str | None, api_key: str | None, show_progress: bool) -> None:
    # Warm-up prompts are shorter than a KV block, so they leave nothing in the prefix cache.
    warmup = [BenchRequest(r.prompt_token_ids[:8], 4) for r in _level_requests(spec, vocab_size, -1)[:2]]
    asyncio.run(run_level(url, warmup, LoadLevel(rate=math.inf), model=model, api_key=api_key))
    for i, level in enumerate(levels):
        log_progress("serve", show_progress, f"server at {level.key}: {spec.num_requests} requests")
        records, duration = asyncio.run(run_level(url, _level_requests(spec, vocab_size, i), level, model=model,
                                                  api_key=api_key, seed=spec.seed + i))
        figures.update(summarize(level.key, records, duration, figures["slo_ttft_ms"], figures["slo_tpot_ms"]))


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
    from tandem.router.app import SERVING_DEFAULTS
    from tandem.workers.llm import LLM

    # Serving options (group_num_cpus, num_replicas, ...) are the server's; the engine takes the rest.
    llm = LLM(model=model_dir, **{k: v for k, v in engine_options.items()
                                  if k != "address" and k not in SERVING_DEFAULTS})
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


@contextmanager
def local_server(model_dir: str, engine_options: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """tandem on a local Ray (or the cluster at `address`), HTTP on a free port: yields (url, model name).

    `engine_options` may hold serving options too (num_replicas, group_num_cpus, ...): they
    override the defaults here (one group with all the cores)."""
    import ray
    from ray import serve

    from tandem.router.app import build_app, local_group_num_cpus

    options = dict(engine_options)
    address = options.pop("address", None)
    cores = os.cpu_count() or 1
    # What `tandem serve` gives a group on one machine: the cores but one (the rest is Serve's).
    group_cpus = local_group_num_cpus(options.get("num_replicas", 1), cores)
    app = build_app({"group_num_cpus": group_cpus, **options, "model": model_dir, "served_model_name": "tandem-bench"})
    ray.init(address=address or "local", num_cpus=None if address else cores + 4, include_dashboard=False,
             log_to_driver=False)
    from tandem.cluster.net import free_port

    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="tandem-bench", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the local server never became healthy"
            time.sleep(0.5)
        yield url, "tandem-bench"
    finally:
        if address:
            serve.delete("tandem-bench")
        else:
            serve.shutdown()
        ray.shutdown()


def register_serve(bench_subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `serve` to `tandem bench`'s subcommands."""
    from tandem.bench.cli import override_help

    p = bench_subparsers.add_parser("serve", help="load test an OpenAI-compatible server (TTFT, TPOT, goodput)",
                                    description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    override_help(p, model="without --url: the local model directory to serve (default: built-in benchmark model)")
    p.add_argument("--url", default=None, help="server base URL (default: serve tandem locally and compare offline)")
    p.add_argument("--served-model", default=None, help="with --url: the model name to send "
                   "(default: the first of the server's /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--request-rates", default=None, help="comma-separated req/s, 'inf' = all at once "
                   "(default 1,2,4,inf; 2,inf with --quick)")
    p.add_argument("--concurrency", default=None, help="comma-separated fixed in-flight counts (instead of rates)")
    p.add_argument("--compare-concurrency", type=int, default=None, help="in flight for the server/offline "
                   "comparison (default 16; 8 with --quick)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn below this "
                   f"(default: the model's; {URL_MODE_VOCAB_SIZE} with --url)")
    p.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS)
    p.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO_TPOT_MS)
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests at fewer levels")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write every figure as one flat JSON object")
    p.add_argument("--plot", default=None, metavar="PATH", help="write the plots to this PNG file")
    p.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    from tandem.bench import report
    from tandem.bench.hardware import machine_figures
    from tandem.bench.systems import resolve_device
    from tandem.router.cli import engine_options

    options = engine_options(args)
    model = options.pop("model", None)
    spec = SERVE_QUICK if args.quick else SERVE_FULL
    if args.num_requests:
        spec = WorkloadSpec(args.num_requests, spec.prompt_len, spec.output_len, spec.seed)
    before = machine_figures(resolve_device("auto"))  # of this machine (the server's too without --url)
    figures = run_serve_bench(
        args.url, args.quick, model=model, served_model=args.served_model, engine_options=options, spec=spec,
        request_rates=[float(r) for r in args.request_rates.split(",")] if args.request_rates else None,
        concurrencies=[int(c) for c in args.concurrency.split(",")] if args.concurrency else None,
        compare_concurrency=args.compare_concurrency, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        api_key=args.api_key, vocab_size=args.vocab_size)
    figures.update(before, load_average_1m_end=os.getloadavg()[0])
    print_serve_table(figures)
    load = max(figures["load_average_1m"], figures["load_average_1m_end"])
    if args.url is None and load > (figures.get("cpu_count") or 1) + 1:
        print(f"warning: load average {load:.1f} on {figures['cpu_count']} cores: other processes shared the CPU, "
              "so these figures (the server/offline ratio above all) are unreliable", file=sys.stderr)
    if args.output_json:
        report.write_json(args.output_json, figures)
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.plot:
        plot_serve(args.plot, figures)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
