"""The served path's figures of `tandem bench serve` beyond its load levels (bench/serve.py
runs them against the tandem it serves itself):

    server_cpu_us_per_token   CPU time (user + system) of the server's whole process tree (Ray's
                              gcs_server and raylet, Serve's controller and proxy, the replicas;
                              read from /proc) per streamed output token, over the compare level
    single_stream_itl_ratio   with the engine's `simulated_step_ms` (BASE, PER_SEQ): ITL p50 of
                              one stream at a time over the simulated step of one sequence,
                              BASE + PER_SEQ ms; what serving adds to a step, per token
    stall_itl_p99_ratio       ITL p99 of STALL_STREAMS streams while one request whose body is a
                              plain-words text prompt of almost 8 MiB arrives, over the ITL p99 of
                              the same number of streams without it; the ingress reads, parses and
                              tokenizes that prompt before refusing it as too long (a 4xx), and
                              any of that done on the path the streams share shows as their stall
    stall_itl_max_ratio       the same for the largest gap: a stall that holds every stream at once
                              is one gap per stream, which p99 misses once streams are long
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.bench.load_generator import LoadLevel, RequestRecord, base_url, httpx, run_level, summarize
from tandem.bench.process_cpu import cpu_by_role, cpu_used, tree_cpu_seconds
from tandem.bench.workload import BenchRequest
from tandem.workers.config import parse_step_ms

SINGLE_STREAM_REQUESTS = 4
STALL_STREAMS = 32
# router/app.py's max_request_body_bytes is 8 MiB, JSON included: the body stays just under it,
# so it is read whole and refused for the prompt's length, not for the body's (413).
STALL_BODY_BYTES = 8 * 1024 * 1024 - 4096
STALL_AFTER_S = 0.5  # the streams are past their first tokens by then (prompts of a few hundred tokens)
STALL_TIMEOUT_S = 600.0
_WORDS = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
          "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you",
          "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will",
          "would", "who", "so", "no", "river", "mountain", "window", "quietly", "number", "language", "morning")


# ---- the server's CPU ------------------------------------------------------------------------------
def read_server_cpu() -> dict[int, float]:
    """{pid: CPU seconds} of every process this one started, directly or not: a local Ray's
    processes and, under its raylet, the workers that hold Serve and the replicas. This process
    runs the load generator and is left out."""
    return tree_cpu_seconds(os.getpid(), include_root=False)


def server_cpu_figures(before: dict[int, float], after: dict[int, float], records: list[RequestRecord],
                       duration_s: float) -> dict[str, Any]:
    """The tree's CPU between two readings around a level, per output token of the level's
    successful requests (processes that ended during it are lost: see `cpu_used`)."""
    cpu_s = cpu_used(before, after)
    num_tokens = sum(r.num_output_tokens for r in records if r.ok)
    per_token = 1e6 / num_tokens if num_tokens else math.nan
    return {"server_cpu_s": cpu_s, "server_cpu_cores": cpu_s / duration_s, "server_num_processes": len(after),
            "server_cpu_us_per_token": cpu_s * per_token,
            # Where it goes: the groups, the ingress, Serve's proxy, Ray's daemons (flat keys).
            **{f"server_cpu_us_per_token_{re.sub(r'[^A-Za-z0-9]+', '_', role)}": s * per_token
               for role, s in cpu_by_role(before, after).items()}}


# ---- ratios (pure) ---------------------------------------------------------------------------------
def simulated_step(engine_options: dict[str, Any]) -> tuple[float, float] | None:
    """(BASE, PER_SEQ) ms of the engine option `simulated_step_ms` (a pair, or "BASE,PER_SEQ"), or None."""
    value = engine_options.get("simulated_step_ms")
    return None if value is None else parse_step_ms(value)


def itl_percentile_ms(itl_s: list[float], p: float) -> float:
    """The p-th percentile of inter-token gaps, in ms (as `summarize` computes it); nan for none."""
    return float(np.percentile(np.asarray(itl_s) * 1000.0, p)) if itl_s else math.nan


def single_stream_itl_ratio(itl_s: list[float], step_ms: tuple[float, float]) -> float:
    """ITL p50 over the simulated step of one running sequence, BASE + PER_SEQ * 1 ms."""
    base, per_seq = step_ms
    return itl_percentile_ms(itl_s, 50) / (base + per_seq)


def stall_itl_p99_ratio(with_stall_itl_s: list[float], without_itl_s: list[float]) -> float:
    return itl_percentile_ms(with_stall_itl_s, 99) / itl_percentile_ms(without_itl_s, 99)


def itl_gaps(records: list[RequestRecord]) -> list[float]:
    return [gap for r in records if r.ok for gap in r.itl_s]


# ---- the stall check -------------------------------------------------------------------------------
def plain_words(num_chars: int, seed: int = 0) -> str:
    """`num_chars` characters of seeded space-separated English words (ASCII: one byte each)."""
    rng = random.Random(seed)
    block = " ".join(rng.choice(_WORDS) for _ in range(16384)) + " "  # ~80 KB, repeated
    return (block * (num_chars // len(block) + 1))[:num_chars]


def stall_body(model: str | None, body_bytes: int = STALL_BODY_BYTES) -> tuple[bytes, int]:
    """(a /v1/completions JSON body of exactly `body_bytes`, its prompt's length in bytes): a
    text prompt filling the body, one token asked for, answered whole."""
    payload: dict[str, Any] = {"prompt": "", "max_tokens": 1, "temperature": 0.0, "stream": False}
    if model:
        payload["model"] = model
    prompt_bytes = body_bytes - len(json.dumps(payload).encode())
    payload["prompt"] = plain_words(prompt_bytes)
    body = json.dumps(payload).encode()
    assert len(body) == body_bytes, (len(body), body_bytes)  # words need no JSON escapes
    return body, prompt_bytes


@dataclass
class StallRequest:
    status: int  # the HTTP status; 0 when no answer came
    sent_at_s: float  # seconds after the streams started
    answered_at_s: float
    error: str = ""


async def streams_with_request(url: str, requests: list[BenchRequest], body: bytes | None, *, model: str | None,
                               after_s: float = STALL_AFTER_S, api_key: str | None = None
                               ) -> tuple[list[RequestRecord], float, StallRequest | None]:
    """All `requests` in flight at once and, `after_s` into them, `body` posted to /v1/completions:
    (the streams' records, their duration, what came of the posted body)."""
    start = time.perf_counter()
    streams = asyncio.create_task(run_level(url, requests, LoadLevel(concurrency=len(requests)), model=model,
                                            api_key=api_key))
    stall = None
    if body is not None:
        await asyncio.sleep(after_s)
        sent = time.perf_counter() - start
        # From a thread, with its own client: writing 8 MiB on this event loop would delay the
        # streams' reads here, and the stall measured would be the load generator's own.
        status, error = await asyncio.to_thread(_post, base_url(url) + "/v1/completions", body, api_key)
        stall = StallRequest(status, sent, time.perf_counter() - start, error)
    records, duration = await streams
    return records, duration, stall


def _post(endpoint: str, body: bytes, api_key: str | None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    try:
        response = httpx.post(endpoint, content=body, headers=headers, timeout=STALL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    return response.status_code, "" if response.status_code == 200 else response.text[:300]


def run_stall_check(url: str, without: list[BenchRequest], with_stall: list[BenchRequest], *, model: str | None,
                    slo_ttft_ms: float, slo_tpot_ms: float, body_bytes: int = STALL_BODY_BYTES,
                    after_s: float = STALL_AFTER_S) -> dict[str, Any]:
    """The streams `without` the big request, then, at once, the streams `with_stall` and it:
    each pass's level figures (`stall_off_*`, `stall_on_*`), the ratio, and the request's fate."""
    body, prompt_bytes = stall_body(model, body_bytes)
    figures: dict[str, Any] = {"stall_streams": len(with_stall), "stall_body_bytes": body_bytes,
                               "stall_prompt_bytes": prompt_bytes, "stall_after_s": after_s}
    gaps: dict[str, list[float]] = {}
    for name, requests, posted in (("stall_off", without, None), ("stall_on", with_stall, body)):
        records, duration, stall = asyncio.run(streams_with_request(url, requests, posted, model=model,
                                                                    after_s=after_s))
        figures.update(summarize(name, records, duration, slo_ttft_ms, slo_tpot_ms))
        gaps[name] = itl_gaps(records)
        figures[f"{name}_itl_max_ms"] = max(gaps[name]) * 1000.0 if gaps[name] else math.nan
    assert stall is not None
    figures["stall_itl_p99_ratio"] = stall_itl_p99_ratio(gaps["stall_on"], gaps["stall_off"])
    # A stall that holds every stream at once is one gap per stream: STALL_STREAMS of the
    # streams' gaps, under 1% of them once streams run past ~100 tokens, where p99 no longer
    # sees it and the largest gap does.
    figures["stall_itl_max_ratio"] = figures["stall_on_itl_max_ms"] / figures["stall_off_itl_max_ms"]
    figures.update(stall_request_status=stall.status, stall_request_error=stall.error,
                   stall_request_sent_at_s=stall.sent_at_s, stall_request_s=stall.answered_at_s - stall.sent_at_s,
                   # False: the streams had ended before the request was sent; it stalled nothing.
                   stall_overlapped=stall.sent_at_s < figures["stall_on_duration_s"])
    return figures
