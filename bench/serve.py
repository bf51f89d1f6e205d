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
import json
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.bench.workload import BenchRequest, WorkloadSpec, make_workload

try:
    import httpx
except ImportError:  # some environments ship it (same API) only as httpx2, the openai client's dependency
    import httpx2 as httpx

SERVE_FULL = WorkloadSpec(num_requests=64, prompt_len=(32, 256), output_len=(32, 128), seed=0)
SERVE_QUICK = WorkloadSpec(num_requests=24, prompt_len=(16, 96), output_len=(16, 48), seed=0)
DEFAULT_RATES = {False: (1.0, 2.0, 4.0, math.inf), True: (2.0, math.inf)}  # by quick
DEFAULT_COMPARE_CONCURRENCY = {False: 16, True: 8}
DEFAULT_SLO_TTFT_MS = 2000.0  # CPU-sized; pass tighter ones for a GPU
DEFAULT_SLO_TPOT_MS = 200.0
URL_MODE_VOCAB_SIZE = 1000  # prompt ids are drawn below this when the server's model is unknown
TARGET_SERVER_VS_OFFLINE = 0.9
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    ok: bool = False
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    group: str = ""  # the replica group that served it (tandem's x-tandem-groups header)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class LoadLevel:
    rate: float | None = None  # requests/s, Poisson; inf = all at once
    concurrency: int | None = None  # closed loop: this many in flight

    def __post_init__(self) -> None:
        assert (self.rate is None) != (self.concurrency is None), "a level is a rate or a concurrency"

    @property
    def key(self) -> str:
        if self.concurrency is not None:
            return f"conc{self.concurrency}"
        return "rateinf" if math.isinf(self.rate) else "rate" + f"{self.rate:g}".replace(".", "p")


# ---- one request ------------------------------------------------------------------------------------
async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> RequestRecord:
    """One streaming completion; chunks with choices count as token arrivals (as vLLM's benchmark does)."""
    record = RequestRecord(num_prompt_tokens=len(payload["prompt"]))
    num_chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return record
            record.group = response.headers.get("x-tandem-groups", "")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:300]
                    return record
                now = time.perf_counter()
                if chunk.get("choices"):
                    if num_chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    num_chunks += 1
                    last = now
                if chunk.get("usage"):
                    record.num_prompt_tokens = chunk["usage"].get("prompt_tokens", record.num_prompt_tokens)
                    record.num_output_tokens = chunk["usage"].get("completion_tokens", 0)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    record.num_cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - start
    record.num_output_tokens = record.num_output_tokens or num_chunks  # a server that sent no usage
    record.ok = num_chunks > 0
    record.error = "" if record.ok else "no tokens streamed"
    return record


def completion_payload(request: BenchRequest, model: str | None) -> dict[str, Any]:
    payload = {"prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    return payload


# ---- one load level ---------------------------------------------------------------------------------
async def run_level(url: str, requests: list[BenchRequest], level: LoadLevel, *, model: str | None,
                    api_key: str | None = None, seed: int = 0) -> tuple[list[RequestRecord], float]:
    """All requests at one load level: (records in request order, seconds from first send to last end)."""
    endpoint = _base_url(url) + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    records: list[RequestRecord | None] = [None] * len(requests)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(None)) as client:
        async def one(i: int) -> None:
            records[i] = await send_request(client, endpoint, completion_payload(requests[i], model))

        start = time.perf_counter()
        if level.concurrency is not None:
            queue = deque(range(len(requests)))

            async def worker() -> None:
                while queue:
                    await one(queue.popleft())

            await asyncio.gather(*(worker() for _ in range(level.concurrency)))
        else:
            tasks = []
            for i, offset in enumerate(arrival_offsets(len(requests), level.rate, seed)):
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return records, duration


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a seeded Poisson process."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def summarize(key: str, records: list[RequestRecord], duration_s: float, slo_ttft_ms: float,
              slo_tpot_ms: float) -> dict[str, Any]:
    """Flat figures of one level, each named `{key}_...`; latencies in ms over successful requests."""
    done = [r for r in records if r.ok]
    values = {"ttft": [r.ttft_s for r in done], "tpot": [r.tpot_s for r in done if r.num_output_tokens > 1],
              "itl": [gap for r in done for gap in r.itl_s], "e2e": [r.e2e_s for r in done]}
    figures: dict[str, Any] = {}
    for metric in METRICS:
        samples = np.asarray(values[metric]) * 1000.0
        figures[f"{key}_{metric}_mean_ms"] = float(samples.mean()) if samples.size else math.nan
        for p in PERCENTILES:
            figures[f"{key}_{metric}_p{p}_ms"] = float(np.percentile(samples, p)) if samples.size else math.nan
    num_output = sum(r.num_output_tokens for r in done)
    num_prompt = sum(r.num_prompt_tokens for r in done)
    good = sum(1 for r in done if r.ttft_s * 1000.0 <= slo_ttft_ms and r.tpot_s * 1000.0 <= slo_tpot_ms)
    figures.update({
        f"{key}_num_completed": len(done), f"{key}_num_failed": len(records) - len(done),
        f"{key}_duration_s": duration_s,
        f"{key}_request_throughput": len(done) / duration_s,
        f"{key}_output_tok_s": num_output / duration_s,
        f"{key}_total_tok_s": (num_prompt + num_output) / duration_s,
        f"{key}_goodput_req_s": good / duration_s,
        f"{key}_slo_attainment": good / len(records) if records else math.nan,
    })
    errors = [r.error for r in records if not r.ok]
    if errors:
        figures[f"{key}_first_error"] = errors[0]
    return figures


# ---- the benchmark ----------------------------------------------------------------------------------
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
        url = _base_url(url)
        figures.update(url=url, model=served_model or _served_model(url, api_key) or "")
        vocab = vocab_size or URL_MODE_VOCAB_SIZE
        _run_levels(url, spec, vocab, levels, figures, figures["model"] or None, api_key, show_progress)
        return figures

    from tandem.workers.demo_model import bench_model_path
    from tandem.workers.models.hf_config import HFModelConfig

    model_dir = os.path.abspath(model or bench_model_path())
    options = dict(engine_options or {})
    vocab = vocab_size or HFModelConfig.from_dir(model_dir).vocab_size
    compare = LoadLevel(concurrency=compare_concurrency or DEFAULT_COMPARE_CONCURRENCY[quick])
    server_levels = levels if compare in levels else levels + [compare]
    figures.update(model=model_dir, compare_concurrency=compare.concurrency)
    _log(show_progress, f"offline engine, {compare.concurrency} in flight")
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
        _log(show_progress, f"server at {level.key}: {spec.num_requests} requests")
        records, duration = asyncio.run(run_level(url, _level_requests(spec, vocab_size, i), level, model=model,
                                                  api_key=api_key, seed=spec.seed + i))
        figures.update(summarize(level.key, records, duration, figures["slo_ttft_ms"], figures["slo_tpot_ms"]))


def _base_url(url: str) -> str:
    """http://host:port from http://host:port[/][v1[/]]."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


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
    from tandem.workers.request import SamplingParams

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
    port = _free_port()
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(show: bool, message: str) -> None:
    if show:
        print(f"[bench serve] {message}", file=sys.stderr, flush=True)


# ---- presenting -------------------------------------------------------------------------------------
_COLUMNS = [("req/s", "request_throughput"), ("out tok/s", "output_tok_s"), ("goodput", "goodput_req_s"),
            ("fail", "num_failed")] + [(f"{m.upper()} p{p}", f"{m}_p{p}_ms") for m in METRICS for p in (50, 99)]


def print_serve_table(figures: dict[str, Any], file: Any = None) -> None:
    levels = [k for k in figures["load_levels"].split(",")]
    if "compare_concurrency" in figures and f"conc{figures['compare_concurrency']}" not in levels:
        levels.append(f"conc{figures['compare_concurrency']}")
    header = ["level"] + [name for name, _ in _COLUMNS]
    rows = [[lv] + [_fmt(figures.get(f"{lv}_{suffix}")) for _, suffix in _COLUMNS] for lv in levels]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = [f"tandem bench serve: {figures.get('url', '')}  ({figures['num_requests']} requests; latencies in ms; "
             f"goodput = req/s with TTFT <= {figures['slo_ttft_ms']:g} ms and TPOT <= {figures['slo_tpot_ms']:g} ms)"]
    for row in [header] + rows:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    if "server_vs_offline_throughput" in figures:
        ratio = figures["server_vs_offline_throughput"]
        verdict = "PASS" if ratio >= TARGET_SERVER_VS_OFFLINE else "FAIL"
        lines.append(f"server_vs_offline_throughput {ratio:.3f} (server {figures['server_output_tok_s']:.1f} vs "
                     f"offline {figures['offline_output_tok_s']:.1f} out tok/s at {figures['compare_concurrency']} "
                     f"in flight; target >= {TARGET_SERVER_VS_OFFLINE}: {verdict})")
    print("\n".join(lines), file=file, flush=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return "nan" if math.isnan(value) else f"{value:.1f}"


def plot_serve(path: str, figures: dict[str, Any]) -> None:
    """Latency percentiles and throughput per load level (drawn from the figures alone)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = figures["load_levels"].split(",")
    x = np.arange(len(levels))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, metric in zip(axes[:3], ("ttft", "tpot", "itl")):
        for p, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            ax.plot(x, [figures[f"{lv}_{metric}_p{p}_ms"] for lv in levels], style, label=f"p{p}")
        slo = figures.get(f"slo_{metric}_ms")
        if slo is not None:
            ax.axhline(slo, color="red", linewidth=0.8, label="SLO")
        ax.set_title(f"{metric.upper()} (ms)")
        ax.set_xticks(x, levels)
        ax.legend(fontsize=8)
    ax = axes[3]
    ax.plot(x, [figures[f"{lv}_output_tok_s"] for lv in levels], "o-", label="output tok/s")
    if "offline_output_tok_s" in figures:
        in_flight = figures["compare_concurrency"]
        ax.axhline(figures["server_output_tok_s"], color="tab:blue", linestyle="--",
                   label=f"server, {in_flight} in flight")
        ax.axhline(figures["offline_output_tok_s"], color="gray", linestyle="--",
                   label=f"offline engine, {in_flight} in flight")
    ax.set_title("throughput")
    ax.set_xticks(x, levels)
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(x, [figures[f"{lv}_goodput_req_s"] for lv in levels], "s:", color="tab:green", label="goodput req/s")
    twin.set_ylabel("goodput (req/s)")
    twin.set_ylim(bottom=0)
    ax.legend(loc="lower left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    title = f"tandem bench serve: {figures['num_requests']} requests"
    if "server_vs_offline_throughput" in figures:
        title += f"; server / offline throughput {figures['server_vs_offline_throughput']:.2f}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------------
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
