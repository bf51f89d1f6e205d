"""`tandem bench prefix`: what prefix-cache-aware routing buys over load-only routing (issue #7).

Workloads (random token ids, seeded; every prompt `prefix_len + suffix_len` tokens, every
output `output_len` tokens, EOS ignored):

    shared     K prefixes of 900 tokens; a request is one of them (each used equally often,
               in shuffled order) + 100 tokens of its own: 90% of its prompt is shared
    no-share   the same lengths, nothing shared

Method. One Ray and Serve on this machine, and one tandem app per routing policy side by
side (`/prefix`: routing "prefix", `/load`: routing "load"), each with two replica groups
of one CPU; only one app has work at a time. Each group's KV cache holds `cache_requests`
whole requests (default K/2 + 0.5): the K prefixes fit in two groups' caches but not in
one, which is where routing matters. A load-only router sends every prefix to both groups,
so each group cycles through all K and its LRU cache keeps evicting them; a prefix-aware
router keeps each prefix on one group. Each repeat draws fresh prefixes (nothing a repeat
cached helps the next), sends both policies the same requests at the same times, and
alternates which policy goes first:

    1. one request per prefix, two in flight (not measured: brings the caches to a steady state)
    2. the shared workload, Poisson arrivals at `request_rate` (measured)
    3. the no-share workload, in rounds of one request per group, the same rounds to both
       policies taking turns (ABBA), so the neighbours' load falls on both alike (measured)

Figures (medians over repeats; TTFT = send -> first streamed chunk):

    routed_ttft_ratio   shared workload p50 TTFT, prefix / load routing           target <= 0.6
    hit_ttft_ratio      TTFT of a request whose 900-token prefix is cached / of a cold
                        request of the same length, one at a time on the prefix app
                        (`num_hit_pairs` pairs, median of each)                    target <= 0.3
    no_share_overhead   no-share workload p50 TTFT, prefix / load routing, - 1    target <= 0.03

On the no-share workload every request is a cold prefill and the prefix router finds nothing
to match, so `no_share_overhead` weighs the router's hashing and lookup against ~2 s of
prefill; on a shared 2-core machine run-to-run noise is of the same order as the target.

Per request the `x-tandem-groups` header and `usage.prompt_tokens_details.cached_tokens` are
kept: per policy, the hit rate (a hit: at least half its shared prefix came from the cache)
and the groups per prefix (1.0: each prefix was served by one group); on the no-share
workload, the fraction of rounds whose requests did not get a group each (`same_group_rounds`:
two cold prefills sharing one group's steps take about twice as long).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tandem.bench.load_generator import LoadLevel, RequestRecord, run_level
from tandem.bench.prefix_workload import (
    LABELS,
    NO_PREFIX,
    POLICIES,
    PrefixBenchConfig,
    hit_pairs,
    no_share_workload,
    shared_workload,
)
from tandem.bench.report import log_progress
from tandem.bench.server import SERVED_MODEL_NAME, AppBuilder, bench_server
from tandem.bench.workload import NUM_SPECIAL_TOKENS, BenchRequest


# ---- figures ----------------------------------------------------------------------------------------
def is_hit(record: RequestRecord, prefix_len: int) -> bool:
    return record.ok and record.num_cached_tokens >= prefix_len // 2


def run_figures(records: list[RequestRecord], prefix_ids: list[int], prefix_len: int) -> dict[str, Any]:
    """One policy's run of one workload: TTFT/E2E percentiles (ms), hit rate, groups per prefix, TTFTs."""
    done = [r for r in records if r.ok]
    ttft = np.asarray([r.ttft_s for r in done]) * 1e3
    e2e = np.asarray([r.e2e_s for r in done]) * 1e3
    groups: dict[int, set[str]] = {}
    for r, p in zip(records, prefix_ids, strict=True):
        if r.ok and p != NO_PREFIX:
            groups.setdefault(p, set()).add(r.group)
    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) if a.size else math.nan

    figures = {
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "e2e_p50_ms": pct(e2e, 50),
        "hit_rate": sum(is_hit(r, prefix_len) for r in done) / len(done) if done else math.nan,
        "num_failed": len(records) - len(done),
        "ttft_samples_ms": sorted(float(t) for t in ttft),
    }
    if any(p != NO_PREFIX for p in prefix_ids):
        figures["groups_per_prefix"] = statistics.mean(len(g) for g in groups.values()) if groups else math.nan
    return figures


def same_group_rounds(records: list[RequestRecord], num_groups: int) -> float:
    """Of the rounds of `num_groups` requests sent together, the fraction that did not get a group each."""
    rounds = [records[i:i + num_groups] for i in range(0, len(records), num_groups)]
    rounds = [r for r in rounds if len(r) == num_groups and all(x.ok for x in r)]
    return sum(len({x.group for x in r}) < num_groups for r in rounds) / len(rounds) if rounds else math.nan


def summarize(runs: dict[tuple[str, str], list[dict[str, Any]]], hit_ttft_s: list[float],
              cold_ttft_s: list[float]) -> dict[str, Any]:
    """Figures over repeats: medians, failures summed, TTFT samples pooled (sorted), p50 per repeat.

    runs[(workload, policy)]: `run_figures` of each repeat, workload "shared" or "no_share"."""
    figures: dict[str, Any] = {}
    for (workload, policy), per_run in runs.items():
        stem = LABELS[policy] if workload == "shared" else f"no_share_{LABELS[policy]}"
        for key in per_run[0]:
            values = [run[key] for run in per_run]
            if key == "ttft_samples_ms":
                figures[f"{stem}_{key}"] = sorted(v for run in values for v in run)
            else:
                figures[f"{stem}_{key}"] = sum(values) if key == "num_failed" else statistics.median(values)
        figures[f"{stem}_ttft_p50_ms_runs"] = [run["ttft_p50_ms"] for run in per_run]
    figures["routed_ttft_ratio"] = figures["routed_ttft_p50_ms"] / figures["load_only_ttft_p50_ms"]
    figures["no_share_overhead"] = (figures["no_share_routed_ttft_p50_ms"]
                                    / figures["no_share_load_only_ttft_p50_ms"] - 1.0)
    figures["hit_ttft_ms"] = statistics.median(hit_ttft_s) * 1e3
    figures["cold_ttft_ms"] = statistics.median(cold_ttft_s) * 1e3
    figures["hit_ttft_ratio"] = figures["hit_ttft_ms"] / figures["cold_ttft_ms"]
    return figures


def verdicts(figures: dict[str, Any]) -> dict[str, Any]:
    """`{name}_target` ("<= 0.3") and `{name}_met` (bool, None when not measured) of the issue's three figures."""
    from tandem.bench.report import TARGETS, meets_target

    out: dict[str, Any] = {}
    for name in ("routed_ttft_ratio", "hit_ttft_ratio", "no_share_overhead"):
        op, bound = TARGETS[name]
        out[f"{name}_target"] = f"{op} {bound:g}"
        out[f"{name}_met"] = meets_target(name, figures.get(name))
    return out


# ---- running it -------------------------------------------------------------------------------------
def run_prefix_bench(cfg: PrefixBenchConfig, local_app: AppBuilder, *, model: str | None = None,
                     engine_options: dict[str, Any] | None = None, idle_wait_s: float = 60.0,
                     show_progress: bool = True) -> dict[str, Any]:
    """Every figure of the benchmark as one flat dict (see the module docstring); the apps are
    built by `local_app` (router.serve_cli.local_app)."""
    from tandem.bench.hardware import wait_for_idle
    from tandem.workers.model.demo_model import bench_model_path
    from tandem.workers.model.hf_config import HFModelConfig

    model_dir = os.path.abspath(model or bench_model_path())
    hf_config = HFModelConfig.from_dir(model_dir)
    options = {"max_model_len": cfg.prompt_len + cfg.output_len, **(engine_options or {})}
    if "kv_cache_memory" not in options and "num_kv_blocks" not in options:
        per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * hf_config.head_dim * 4
        options["kv_cache_memory"] = cfg.cache_tokens * per_token  # float32; a wider dtype gets more tokens
    waited = wait_for_idle(idle_wait_s) if idle_wait_s > 0 else 0.0
    figures: dict[str, Any] = {
        "model": model_dir, "num_groups": cfg.num_groups, "num_prefixes": cfg.num_prefixes,
        "prefix_len": cfg.prefix_len, "suffix_len": cfg.suffix_len, "output_len": cfg.output_len,
        "num_requests": cfg.num_requests, "num_no_share": cfg.num_no_share, "request_rate": cfg.request_rate,
        "cache_tokens_per_group": cfg.cache_tokens, "kv_cache_memory": options["kv_cache_memory"],
        "repeats": cfg.repeats, "num_hit_pairs": cfg.num_hit_pairs, "workload_seed": cfg.seed,
        "idle_waited_s": waited, "load_average_1m": os.getloadavg()[0],
    }
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    with policy_servers(local_app, model_dir, options, cfg.num_groups) as urls:
        for r in range(cfg.repeats):
            seed = cfg.seed + 1000 * r
            shared = shared_workload(cfg, hf_config.vocab_size, seed)
            no_share = no_share_workload(cfg, hf_config.vocab_size, seed + 1)
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            for policy in order:
                log_progress("prefix", show_progress,
                             f"repeat {r + 1}/{cfg.repeats}, routing {policy!r}: {len(shared.warmup)} warm-up, "
                             f"then {cfg.num_requests} shared requests at {cfg.request_rate:g} req/s")
                _send(urls[policy], shared.warmup, LoadLevel(concurrency=cfg.num_groups))
                records = _send(urls[policy], shared.requests, LoadLevel(rate=cfg.request_rate), seed)
                runs.setdefault(("shared", policy), []).append(run_figures(records, shared.prefix_ids, cfg.prefix_len))
            log_progress("prefix", show_progress,
                         f"repeat {r + 1}/{cfg.repeats}: {cfg.num_no_share} no-share requests per routing")
            for policy, records in _no_share_rounds(urls, no_share.requests, cfg.num_groups, order).items():
                run = run_figures(records, no_share.prefix_ids, cfg.prefix_len)
                run["same_group_rounds"] = same_group_rounds(records, cfg.num_groups)
                runs.setdefault(("no_share", policy), []).append(run)
        log_progress("prefix", show_progress,
                     f"{cfg.num_hit_pairs} cold/hit pairs, one request at a time, routing 'prefix'")
        hit_s, cold_s, cached = [], [], []
        for cold, hit in hit_pairs(cfg, hf_config.vocab_size, cfg.seed + 999_999):
            cold_record, hit_record = (_send(urls["prefix"], [req], LoadLevel(concurrency=1))[0]
                                       for req in (cold, hit))
            assert cold_record.ok and hit_record.ok, cold_record.error or hit_record.error
            cold_s.append(cold_record.ttft_s)
            hit_s.append(hit_record.ttft_s)
            cached.append(hit_record.num_cached_tokens)
    figures.update(summarize(runs, hit_s, cold_s))
    figures["hit_pair_min_cached_tokens"] = min(cached)
    figures.update(verdicts(figures))
    figures["load_average_1m_end"] = os.getloadavg()[0]
    return figures


def _no_share_rounds(urls: dict[str, str], requests: list[BenchRequest], num_groups: int,
                     order: tuple[str, ...]) -> dict[str, list[RequestRecord]]:
    """The same requests to every policy in rounds of one per group, the policies taking turns
    (ABBA), so a neighbour's load lands on both alike."""
    records: dict[str, list[RequestRecord]] = {policy: [] for policy in order}
    for j, start in enumerate(range(0, len(requests), num_groups)):
        for policy in (order if j % 2 == 0 else order[::-1]):
            level = LoadLevel(concurrency=num_groups)
            records[policy] += _send(urls[policy], requests[start:start + num_groups], level)
    return records


def _send(url: str, requests: list[BenchRequest], level: LoadLevel, seed: int = 0) -> list[RequestRecord]:
    records, _ = asyncio.run(run_level(url, requests, level, model=SERVED_MODEL_NAME, seed=seed))
    return records


@contextmanager
def policy_servers(local_app: AppBuilder, model_dir: str, options: dict[str, Any],
                   num_groups: int) -> Iterator[dict[str, str]]:
    """One app per routing policy at /<policy>, warmed up: yields {policy: url}."""
    # The policies take turns, so each app's groups share all the cores (one each on 2 cores:
    # Ray sets a group's torch threads from its CPUs), and Ray gets logical CPUs for both apps.
    group_cpus = max(1, (os.cpu_count() or 1) // num_groups)
    apps = {policy: {**options, "model": model_dir, "routing": policy, "num_replicas": num_groups,
                     "group_num_cpus": group_cpus} for policy in POLICIES}
    with bench_server(local_app, apps, num_cpus=len(POLICIES) * num_groups * group_cpus + 4) as urls:
        for url in urls.values():
            # Prompts shorter than a block: the first calls' one-off costs, nothing cached.
            _send(url, [BenchRequest(list(range(NUM_SPECIAL_TOKENS, NUM_SPECIAL_TOKENS + 8)), 4)] * num_groups,
                  LoadLevel(concurrency=num_groups))
        yield urls
