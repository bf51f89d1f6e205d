"""The load generator of `tandem bench serve`: streamed requests to any OpenAI-compatible
server, Poisson arrivals or a fixed number in flight, and per-level latency figures.

Per request:

    TTFT  send -> first streamed chunk        ITL   gaps between chunks
    E2E   send -> end of stream               TPOT  (E2E - TTFT) / (output tokens - 1)

Per level: p50/p90/p99 of each, request and token throughput, and goodput (requests per
second that met every SLO).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from tandem.bench.workload import BenchRequest

# httpx is re-exported for the synchronous callers (serve_figures.py's stall check, the tests).
try:
    import httpx  # noqa: F401
except ImportError:  # some environments ship it (same API) only as httpx2, the openai client's dependency
    import httpx2 as httpx  # noqa: F401

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
# The requests go through aiohttp (its HTTP parser is C), as vLLM's benchmark sends them: the load
# generator shares the machine with the server it measures, and the lighter it is, the less it
# takes from the server's cores between the server's own steps.
_CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError)


async def send_request(client: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> RequestRecord:
    """One streaming completion; chunks with choices count as token arrivals (as vLLM's benchmark does)."""
    record = RequestRecord(num_prompt_tokens=len(payload["prompt"]))
    num_chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                record.error = f"HTTP {response.status}: {body[:300]}"
                return record
            record.group = response.headers.get("x-tandem-groups", "")
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
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
                    _take_usage(record, chunk["usage"])
    except _CLIENT_ERRORS as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - start
    record.num_output_tokens = record.num_output_tokens or num_chunks  # a server that sent no usage
    record.ok = num_chunks > 0
    record.error = "" if record.ok else "no tokens streamed"
    return record


async def send_whole_request(client: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> RequestRecord:
    """One non-streaming completion: its first token reaches the client with its last, so its
    TTFT is its E2E (and its TPOT 0)."""
    record = RequestRecord(num_prompt_tokens=len(payload["prompt"]))
    start = time.perf_counter()
    try:
        async with client.post(url, json=payload) as response:
            raw = await response.read()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {raw.decode(errors='replace')[:300]}"
                return record
            body = json.loads(raw)
            record.group = response.headers.get("x-tandem-groups", "")
    except _CLIENT_ERRORS as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = record.ttft_s = time.perf_counter() - start
    _take_usage(record, body.get("usage") or {})
    record.ok = bool(body.get("choices")) and record.num_output_tokens > 0
    record.error = "" if record.ok else "no tokens in the response"
    return record


def _take_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    """A response's OpenAI `usage` into the record (the prompt's own count where it has none)."""
    record.num_prompt_tokens = usage.get("prompt_tokens", record.num_prompt_tokens)
    record.num_output_tokens = usage.get("completion_tokens", 0)
    record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def completion_payload(request: BenchRequest, model: str | None, stream: bool = True) -> dict[str, Any]:
    payload = {"prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    if model:
        payload["model"] = model
    return payload


# ---- one load level ---------------------------------------------------------------------------------
async def run_level(url: str, requests: list[BenchRequest], level: LoadLevel, *, model: str | None,
                    api_key: str | None = None, seed: int = 0, stream: bool = True
                    ) -> tuple[list[RequestRecord], float]:
    """All requests at one load level: (records in request order, seconds from first send to last end).
    `stream` False: each request is answered whole (`send_whole_request`)."""
    endpoint = base_url(url) + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records: list[RequestRecord | None] = [None] * len(requests)
    send = send_request if stream else send_whole_request
    connector = aiohttp.TCPConnector(limit=len(requests) + 1)
    # No total timeout (a level runs as long as it runs); reading a line of any length.
    async with aiohttp.ClientSession(headers=headers, connector=connector, read_bufsize=1 << 20,
                                     timeout=aiohttp.ClientTimeout(total=None)) as client:
        async def one(i: int) -> None:
            records[i] = await send(client, endpoint, completion_payload(requests[i], model, stream))

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


def base_url(url: str) -> str:
    """http://host:port from http://host:port[/][v1[/]]."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url
