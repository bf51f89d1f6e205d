"""`tandem bench prefix` without a server: the workloads (exact sharing, seeded) and the figures."""

from __future__ import annotations

import math

import pytest

from tandem.bench import prefix as bench_prefix
from tandem.bench import report
from tandem.bench.load_generator import RequestRecord
from tandem.bench.prefix import run_figures, same_group_rounds, summarize, verdicts
from tandem.bench.prefix_report import plot_prefix, table_rows
from tandem.bench.prefix_workload import (
    NO_PREFIX,
    PREFIX_QUICK,
    PrefixBenchConfig,
    hit_pairs,
    no_share_workload,
    shared_workload,
)
from tandem.bench.workload import NUM_SPECIAL_TOKENS, BenchRequest

CFG = PrefixBenchConfig(num_prefixes=3, prefix_len=18, suffix_len=2, output_len=4, num_requests=8, num_no_share=5,
                        num_hit_pairs=2)
VOCAB = 50


def test_shared_workload_shares_exactly_the_prefix() -> None:
    w = shared_workload(CFG, VOCAB, seed=7)
    assert len(w.requests) == 8 and len(w.prefixes) == 3
    assert sorted(w.prefix_ids) == [0, 0, 0, 1, 1, 1, 2, 2]  # each prefix equally often, +-1
    for req, p in zip(w.requests, w.prefix_ids, strict=True):
        assert len(req.prompt_token_ids) == 20 and req.output_len == 4
        assert req.prompt_token_ids[:18] == w.prefixes[p]
    assert len({tuple(r.prompt_token_ids) for r in w.requests}) == 8  # suffixes are each request's own
    assert [r.prompt_token_ids[:18] for r in w.warmup] == w.prefixes
    assert all(NUM_SPECIAL_TOKENS <= t < VOCAB for r in w.requests + w.warmup for t in r.prompt_token_ids)


def test_workloads_are_seeded() -> None:
    assert shared_workload(CFG, VOCAB, seed=7) == shared_workload(CFG, VOCAB, seed=7)
    assert shared_workload(CFG, VOCAB, seed=7).prefixes != shared_workload(CFG, VOCAB, seed=8).prefixes
    assert no_share_workload(CFG, VOCAB, seed=1) == no_share_workload(CFG, VOCAB, seed=1)


def test_no_share_workload_has_the_same_lengths_and_no_common_block() -> None:
    w = no_share_workload(CFG, 10**6, seed=1)
    assert w.prefix_ids == [NO_PREFIX] * 5 and w.prefixes == []
    assert all(len(r.prompt_token_ids) == 20 and r.output_len == 4 for r in w.requests)
    assert len({tuple(r.prompt_token_ids[:4]) for r in w.requests}) == 5


def test_hit_pairs_share_the_prefix_only() -> None:
    pairs = hit_pairs(CFG, VOCAB, seed=3)
    assert len(pairs) == 2
    for cold, hit in pairs:
        assert cold.prompt_token_ids[:18] == hit.prompt_token_ids[:18]
        assert cold.prompt_token_ids != hit.prompt_token_ids
    assert pairs[0][0].prompt_token_ids[:18] != pairs[1][0].prompt_token_ids[:18]


def test_config_sizes_the_cache_and_rejects_bad_values() -> None:
    assert CFG.prompt_len == 20
    assert CFG.cache_tokens == math.ceil((3 / 2 + 0.5) * 24)  # K/2 + 0.5 whole requests
    assert PrefixBenchConfig(cache_requests=3.0).cache_tokens == 3 * 1008
    assert PREFIX_QUICK.repeats == 2
    with pytest.raises(ValueError, match="num_prefixes"):
        PrefixBenchConfig(num_prefixes=0)
    with pytest.raises(ValueError, match="request_rate"):
        PrefixBenchConfig(request_rate=0.0)


def _record(ttft_s: float, group: str, cached: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(ok=ok, ttft_s=ttft_s, e2e_s=ttft_s + 0.1, num_cached_tokens=cached, group=group)


def test_run_figures_on_fabricated_records() -> None:
    records = [_record(1.0, "a", 0), _record(0.2, "a", 16), _record(0.3, "b", 9), _record(0.4, "b", 8),
               _record(9.0, "b", 16, ok=False)]
    f = run_figures(records, [0, 0, 1, 1, 0], prefix_len=18)
    assert f["ttft_p50_ms"] == pytest.approx(350.0)
    assert f["e2e_p50_ms"] == pytest.approx(450.0)
    assert f["hit_rate"] == 0.5  # a hit: at least half the 18-token prefix cached (16 and 9, not 8 or 0)
    assert f["groups_per_prefix"] == 1.0  # prefix 0 on a (the failed one on b does not count), 1 on b
    assert f["num_failed"] == 1
    assert f["ttft_samples_ms"] == pytest.approx([200.0, 300.0, 400.0, 1000.0])
    assert "groups_per_prefix" not in run_figures(records, [-1] * 5, prefix_len=18)  # no-share: nothing to count


def test_same_group_rounds() -> None:
    records = [_record(1.0, g, 0) for g in ("a", "b", "a", "a", "b", "a", "b")] + [_record(1.0, "a", 0, ok=False)]
    assert same_group_rounds(records, 2) == pytest.approx(1 / 3)  # ab, aa, ba count; b + failed does not


def test_summarize_takes_medians_and_the_ratios() -> None:
    def run(p50: float, hit: float = 0.0, failed: int = 0) -> dict:
        return {"ttft_p50_ms": p50, "hit_rate": hit, "num_failed": failed, "ttft_samples_ms": [p50]}

    runs = {("shared", "prefix"): [run(300.0, 0.9), run(500.0, 0.8, failed=1)],
            ("shared", "load"): [run(1000.0, 0.4), run(1000.0, 0.2)],
            ("no_share", "prefix"): [run(2020.0), run(2040.0)],
            ("no_share", "load"): [run(2000.0), run(2000.0)]}
    f = summarize(runs, hit_ttft_s=[0.2, 0.3, 0.9], cold_ttft_s=[2.0, 1.0, 1.5])
    assert f["routed_ttft_p50_ms"] == 400.0 and f["load_only_ttft_p50_ms"] == 1000.0
    assert f["routed_ttft_ratio"] == pytest.approx(0.4)
    assert f["routed_hit_rate"] == pytest.approx(0.85) and f["load_only_hit_rate"] == pytest.approx(0.3)
    assert f["routed_num_failed"] == 1
    assert f["no_share_overhead"] == pytest.approx(0.015)
    assert f["hit_ttft_ms"] == pytest.approx(300.0) and f["cold_ttft_ms"] == pytest.approx(1500.0)
    assert f["hit_ttft_ratio"] == pytest.approx(0.2)
    assert f["routed_ttft_p50_ms_runs"] == [300.0, 500.0]
    assert f["load_only_ttft_samples_ms"] == [1000.0, 1000.0]
    v = verdicts(f)
    assert v == {"routed_ttft_ratio_target": "<= 0.6", "routed_ttft_ratio_met": True,
                 "hit_ttft_ratio_target": "<= 0.3", "hit_ttft_ratio_met": True,
                 "no_share_overhead_target": "<= 0.03", "no_share_overhead_met": True}


def test_no_share_rounds_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_send(url, requests, level, seed=0):
        calls.append((url, [r.output_len for r in requests], level.concurrency))
        return [RequestRecord(ok=True, num_output_tokens=r.output_len) for r in requests]

    monkeypatch.setattr(bench_prefix, "_send", fake_send)
    requests = [BenchRequest([5], i) for i in range(5)]
    out = bench_prefix._no_share_rounds({"prefix": "P", "load": "L"}, requests, 2, ("load", "prefix"))
    assert calls == [("L", [0, 1], 2), ("P", [0, 1], 2), ("P", [2, 3], 2), ("L", [2, 3], 2),
                     ("L", [4], 2), ("P", [4], 2)]
    assert [r.num_output_tokens for r in out["prefix"]] == [0, 1, 2, 3, 4] == [r.num_output_tokens for r in out["load"]]


def _figures() -> dict:
    runs = {(w, p): [{"ttft_p50_ms": 100.0 + i, "hit_rate": 0.5, "num_failed": 0,
                      "ttft_samples_ms": [90.0 + i, 100.0 + i, 110.0 + i]} for i in range(2)]
            for w in ("shared", "no_share") for p in ("prefix", "load")}
    f = summarize(runs, [0.2], [1.0])
    f.update(num_groups=2, num_prefixes=3, prefix_len=18, suffix_len=2, num_requests=8, request_rate=1.0, repeats=2)
    return f


def test_table_and_json_and_plot(tmp_path) -> None:
    f = _figures()
    rows = table_rows(f)
    assert [r[0] for r in rows[:3]] == ["routed_ttft_ratio", "hit_ttft_ratio", "no_share_overhead"]
    assert all(report.TARGETS[n] for n, _, _ in rows[:3])
    report.write_json(str(tmp_path / "prefix.json"), {**f, **verdicts(f)})
    plot_prefix(str(tmp_path / "prefix.png"), f)
    assert (tmp_path / "prefix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
