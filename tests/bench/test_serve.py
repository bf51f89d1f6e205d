"""`tandem bench serve` against a fake OpenAI streaming server (tests/bench/conftest.py): metrics
math, requests sent, outputs."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from tandem.bench import load_generator, report, serve_report
from tandem.bench import serve as bench_serve
from tandem.bench.load_generator import LoadLevel, RequestRecord, arrival_offsets, summarize
from tandem.bench.serve import run_serve_bench
from tandem.bench.workload import BenchRequest, WorkloadSpec, make_workload
from tests.bench.conftest import FIRST_TOKEN_S, PNG_MAGIC, TOKEN_GAP_S

SPEC = WorkloadSpec(num_requests=6, prompt_len=(4, 9), output_len=(3, 5), seed=1)


# ---- pure math ------------------------------------------------------------------------------------
def test_summarize_exact() -> None:
    records = [
        RequestRecord(ok=True, ttft_s=0.1, e2e_s=0.4, itl_s=[0.1, 0.2], num_prompt_tokens=10, num_output_tokens=3),
        RequestRecord(ok=True, ttft_s=0.3, e2e_s=0.3, itl_s=[], num_prompt_tokens=5, num_output_tokens=1),
        RequestRecord(ok=False, error="HTTP 503: busy"),
    ]
    assert records[0].tpot_s == pytest.approx(0.15) and records[1].tpot_s == 0.0
    f = summarize("rate2", records, duration_s=2.0, slo_ttft_ms=200.0, slo_tpot_ms=200.0)
    assert f["rate2_num_completed"] == 2 and f["rate2_num_failed"] == 1
    assert f["rate2_first_error"] == "HTTP 503: busy"
    assert f["rate2_request_throughput"] == pytest.approx(1.0)
    assert f["rate2_output_tok_s"] == pytest.approx(2.0)  # 4 tokens / 2 s
    assert f["rate2_total_tok_s"] == pytest.approx(9.5)  # (15 + 4) / 2 s
    assert f["rate2_ttft_p50_ms"] == pytest.approx(200.0) and f["rate2_ttft_mean_ms"] == pytest.approx(200.0)
    assert f["rate2_ttft_p99_ms"] == pytest.approx(298.0)  # linear interpolation between 100 and 300
    assert f["rate2_tpot_p50_ms"] == pytest.approx(150.0)  # single-token outputs have no TPOT
    assert f["rate2_itl_p50_ms"] == pytest.approx(150.0) and f["rate2_itl_p90_ms"] == pytest.approx(190.0)
    assert f["rate2_e2e_p90_ms"] == pytest.approx(390.0)
    # Only the first request meets TTFT <= 200 ms (the second's 300 ms does not); the failed one counts as missed.
    assert f["rate2_goodput_req_s"] == pytest.approx(0.5)
    assert f["rate2_slo_attainment"] == pytest.approx(1 / 3)


def test_summarize_with_no_successes_gives_nan_latencies() -> None:
    f = summarize("conc4", [RequestRecord(error="x")], duration_s=1.0, slo_ttft_ms=1.0, slo_tpot_ms=1.0)
    assert math.isnan(f["conc4_ttft_p50_ms"]) and f["conc4_output_tok_s"] == 0.0 and f["conc4_num_failed"] == 1


def test_arrivals_are_seeded_poisson() -> None:
    offsets = arrival_offsets(2000, rate=4.0, seed=3)
    assert offsets == arrival_offsets(2000, rate=4.0, seed=3) != arrival_offsets(2000, rate=4.0, seed=4)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    assert arrival_offsets(3, rate=math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_level_keys() -> None:
    assert [LoadLevel(rate=r).key for r in (2.0, 0.5, math.inf)] == ["rate2", "rate0p5", "rateinf"]
    assert LoadLevel(concurrency=8).key == "conc8"


# ---- against the fake server -------------------------------------------------------------------------
def test_run_serve_bench_measures_the_fake_server(fake_server, tmp_path) -> None:
    server, url = fake_server
    figures = run_serve_bench(url + "/v1/", True, spec=SPEC, request_rates=[50.0, math.inf], vocab_size=100,
                              slo_ttft_ms=1000.0, slo_tpot_ms=1000.0, show_progress=False)
    assert figures["model"] == "fake-model" and figures["load_levels"] == "rate50,rateinf"
    bodies = server.bodies[2:]  # after two warm-up requests
    assert len(bodies) == 2 * SPEC.num_requests
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "fake-model"
        assert 4 <= len(body["prompt"]) <= 9 and all(5 <= t < 100 for t in body["prompt"])
        assert 3 <= body["max_tokens"] <= 5
    # Level i sends the request set of seed SPEC.seed + i (no prefix-cache hits across levels).
    for i, level_bodies in enumerate((bodies[:6], bodies[6:])):
        expected = make_workload(WorkloadSpec(6, (4, 9), (3, 5), seed=SPEC.seed + i), vocab_size=100)
        assert sorted((b["prompt"], b["max_tokens"]) for b in level_bodies) == sorted(
            (r.prompt_token_ids, r.output_len) for r in expected)
    for key in ("rate50", "rateinf"):
        assert figures[f"{key}_num_completed"] == SPEC.num_requests and figures[f"{key}_num_failed"] == 0
        # The server's delays are lower bounds; the upper bounds leave room for a busy CI machine
        # (chunks sent apart can arrive together, so single gaps may be short, never the sums).
        assert FIRST_TOKEN_S * 1000 <= figures[f"{key}_ttft_p50_ms"] < FIRST_TOKEN_S * 1000 + 500
        assert figures[f"{key}_e2e_p50_ms"] >= (FIRST_TOKEN_S + 2 * TOKEN_GAP_S) * 1000
        assert figures[f"{key}_e2e_p99_ms"] >= (FIRST_TOKEN_S + 4 * TOKEN_GAP_S) * 1000
        assert 0 < figures[f"{key}_itl_p50_ms"] < TOKEN_GAP_S * 1000 + 300
        assert 0 < figures[f"{key}_tpot_p50_ms"] < TOKEN_GAP_S * 1000 + 300
        assert figures[f"{key}_ttft_p50_ms"] <= figures[f"{key}_ttft_p90_ms"] <= figures[f"{key}_ttft_p99_ms"]
        duration = figures[f"{key}_duration_s"]
        num_output = sum(b["max_tokens"] for b in (bodies[:6] if key == "rate50" else bodies[6:]))
        assert figures[f"{key}_output_tok_s"] == pytest.approx(num_output / duration)
        assert figures[f"{key}_goodput_req_s"] == pytest.approx(SPEC.num_requests / duration)

    path = tmp_path / "serve.json"
    report.write_json(str(path), figures)
    loaded = json.loads(path.read_text())
    assert all(not isinstance(v, (dict, list)) for v in loaded.values())
    for key in ("rate50", "rateinf"):
        for metric in ("ttft", "tpot", "itl", "e2e"):
            for p in (50, 90, 99):
                assert f"{key}_{metric}_p{p}_ms" in loaded
        for name in ("request_throughput", "output_tok_s", "total_tok_s", "goodput_req_s", "duration_s"):
            assert f"{key}_{name}" in loaded
    for name in ("slo_ttft_ms", "slo_tpot_ms", "num_requests", "url", "model"):
        assert name in loaded
    serve_report.plot_serve(str(tmp_path / "serve.png"), loaded)
    assert (tmp_path / "serve.png").read_bytes()[:8] == PNG_MAGIC


def test_fixed_concurrency_and_failures(fake_server, capsys) -> None:
    server, url = fake_server
    requests = [BenchRequest([7] * 4, 3), BenchRequest([7] * 6, 3), BenchRequest([7] * 4, 3), BenchRequest([7] * 4, 3)]
    server.fail_prompt_len = 6
    records, duration = asyncio.run(load_generator.run_level(url, requests, LoadLevel(concurrency=2), model=None))
    assert [r.ok for r in records] == [True, False, True, True]
    assert records[1].error.startswith("HTTP 400") and "too long" in records[1].error
    assert all("model" not in b for b in server.bodies)
    # Two in flight: three 3-token requests need two rounds of ~(80 + 2 * 20) ms.
    assert duration >= 2 * (FIRST_TOKEN_S + 2 * TOKEN_GAP_S)
    assert records[0].num_output_tokens == 3 and len(records[0].itl_s) == 2


def test_requests_answered_whole(fake_server, tmp_path, capsys, monkeypatch) -> None:
    server, url = fake_server
    requests = [BenchRequest([7] * 4, 3), BenchRequest([7] * 6, 5)]
    server.fail_prompt_len = 6
    records, _ = asyncio.run(load_generator.run_level(url, requests, LoadLevel(concurrency=2), model="m",
                                                      stream=False))
    assert [b["stream"] for b in server.bodies] == [False, False]
    assert all("stream_options" not in b and b["model"] == "m" for b in server.bodies)
    ok, failed = records
    assert ok.ok and (ok.num_prompt_tokens, ok.num_output_tokens, ok.group) == (4, 3, "g1")
    assert ok.ttft_s == ok.e2e_s >= FIRST_TOKEN_S + 2 * TOKEN_GAP_S and ok.tpot_s == 0.0 and ok.itl_s == []
    assert not failed.ok and failed.error.startswith("HTTP 400") and "too long" in failed.error

    from tandem.cli.main import main

    server.fail_prompt_len = None
    monkeypatch.setattr(bench_serve, "SERVE_FULL", SPEC)
    out_json = tmp_path / "out.json"
    assert main(["bench", "serve", "--url", url, "--num-requests", "3", "--concurrency", "3", "--no-stream",
                 "--vocab-size", "50", "--output-json", str(out_json)]) == 0
    figures = json.loads(out_json.read_text())
    assert figures["stream"] is False and figures["conc3_num_completed"] == 3
    assert figures["conc3_ttft_p50_ms"] == figures["conc3_e2e_p50_ms"]
    assert "(3 requests; answered whole, so TTFT is E2E; latencies in ms;" in capsys.readouterr().out
    assert all(b["stream"] is False for b in server.bodies[2:])


def test_cli_against_a_url(fake_server, tmp_path, capsys, monkeypatch) -> None:
    from tandem.cli.main import main

    _, url = fake_server
    monkeypatch.setattr(bench_serve, "SERVE_FULL", SPEC)  # short outputs: a fast test
    out_json = tmp_path / "out.json"
    assert main(["bench", "serve", "--url", url, "--num-requests", "3", "--concurrency", "1,3",
                 "--vocab-size", "50", "--output-json", str(out_json)]) == 0
    figures = json.loads(out_json.read_text())
    assert figures["load_levels"] == "conc1,conc3" and figures["num_requests"] == 3
    assert figures["conc3_num_completed"] == 3
    printed = capsys.readouterr().out
    assert "conc1" in printed and "TTFT p50" in printed


def test_serving_here_needs_an_app_builder() -> None:
    with pytest.raises(ValueError, match="local_app"):
        run_serve_bench(None, True, spec=SPEC)


def test_fixed_prompt_and_output_lengths(fake_server, tmp_path) -> None:
    from tandem.cli.main import main

    server, url = fake_server
    out_json = tmp_path / "out.json"
    assert main(["bench", "serve", "--url", url, "--num-requests", "3", "--concurrency", "3", "--prompt-len", "7",
                 "--output-len", "4", "--vocab-size", "50", "--output-json", str(out_json)]) == 0
    figures = json.loads(out_json.read_text())
    lengths = ("prompt_len_min", "prompt_len_max", "output_len_min", "output_len_max")
    assert [figures[k] for k in lengths] == [7, 7, 4, 4]
    assert [(len(b["prompt"]), b["max_tokens"]) for b in server.bodies[2:]] == [(7, 4)] * 3  # after the warm-up
    # The served path's figures are measured only on a tandem served here.
    assert not any(k.startswith(("stall_", "single_stream", "server_cpu")) for k in figures)


def test_the_served_path_levels_against_the_fake_server(fake_server) -> None:
    server, url = fake_server
    figures = {"slo_ttft_ms": 1000.0, "slo_tpot_ms": 1000.0}
    bench_serve._single_stream(url, SPEC, 100, 5, (6.0, 0.5), figures, show_progress=False)
    assert figures["single_stream_num_completed"] == 4 and len(server.bodies) == 4
    assert all(b["model"] == "tandem-bench" for b in server.bodies)
    assert (figures["simulated_step_base_ms"], figures["simulated_step_per_seq_ms"]) == (6.0, 0.5)
    assert figures["single_stream_itl_ratio"] == pytest.approx(figures["single_stream_itl_p50_ms"] / 6.5)
    bench_serve._stall_check(url, SPEC, 100, 6, figures, show_progress=False)
    # 32 streams without, 32 with, and the 8 MiB body (over the fake server's 1 MiB limit: never parsed).
    assert (figures["stall_off_num_completed"], figures["stall_on_num_completed"]) == (32, 32)
    assert len(server.bodies) == 4 + 64 and figures["stall_body_bytes"] == 8 * 1024 * 1024 - 4096
    token_sets = [b["prompt"] for b in server.bodies[4:36]], [b["prompt"] for b in server.bodies[36:]]
    assert not set(map(tuple, token_sets[0])) & set(map(tuple, token_sets[1]))  # two request sets
