"""The served path's figures of `tandem bench serve`: the ratios' arithmetic, the 8 MiB stall
request's body, the server's CPU per token, and the stall check against the fake server
(tests/bench/conftest.py); how the summary prints them."""

from __future__ import annotations

import io
import json
import math

import pytest

from tandem.bench import serve_figures as sf
from tandem.bench.load_generator import RequestRecord
from tandem.bench.serve_report import print_serve_table, served_path_lines
from tandem.bench.workload import BenchRequest


def test_simulated_step_reads_the_engine_option() -> None:
    assert sf.simulated_step({}) is None and sf.simulated_step({"simulated_step_ms": None}) is None
    assert sf.simulated_step({"simulated_step_ms": (5.9, 0.01)}) == (5.9, 0.01)
    assert sf.simulated_step({"simulated_step_ms": "6,0.5"}) == (6.0, 0.5)


def test_single_stream_ratio_is_the_itl_median_over_one_sequences_step() -> None:
    # ITL p50 of [5, 6, 7, 8] ms is 6.5 ms; the step of one sequence is 6 + 0.5 = 6.5 ms.
    assert sf.single_stream_itl_ratio([0.005, 0.008, 0.006, 0.007], (6.0, 0.5)) == pytest.approx(1.0)
    assert sf.single_stream_itl_ratio([0.013], (6.0, 0.5)) == pytest.approx(2.0)
    assert math.isnan(sf.single_stream_itl_ratio([], (6.0, 0.5)))


def test_stall_ratio_is_of_the_two_itl_p99s() -> None:
    without = [0.01] * 100  # p99 10 ms
    with_stall = [0.01] * 99 + [0.5]  # p99 at rank 98.01 of 0..99: 10 ms + 0.01 * (500 - 10) ms = 14.9 ms
    assert sf.itl_percentile_ms(with_stall, 99) == pytest.approx(14.9)
    assert sf.stall_itl_p99_ratio(with_stall, without) == pytest.approx(1.49)
    records = [RequestRecord(ok=True, itl_s=[0.1, 0.2]), RequestRecord(ok=False, itl_s=[9.0]),
               RequestRecord(ok=True, itl_s=[0.3])]
    assert sf.itl_gaps(records) == [0.1, 0.2, 0.3]  # a failed stream's gaps are left out


def test_stall_body_fills_exactly_the_size_with_plain_words() -> None:
    body, prompt_bytes = sf.stall_body("tandem-bench")
    assert len(body) == sf.STALL_BODY_BYTES == 8 * 1024 * 1024 - 4096
    payload = json.loads(body)
    assert len(payload["prompt"]) == prompt_bytes == sf.STALL_BODY_BYTES - len(
        b'{"prompt": "", "max_tokens": 1, "temperature": 0.0, "stream": false, "model": "tandem-bench"}')
    assert (payload["max_tokens"], payload["stream"], payload["model"]) == (1, False, "tandem-bench")
    words = set(payload["prompt"][:100_000].split())
    assert words <= set(sf._WORDS) | {payload["prompt"][:100_000].split()[-1]}  # the cut may end mid-word
    assert sf.plain_words(50) == sf.plain_words(50) and len(sf.plain_words(50)) == 50
    body, _ = sf.stall_body(None, 2048)
    assert len(body) == 2048 and "model" not in json.loads(body)


def test_server_cpu_per_token_counts_the_successful_streams_tokens() -> None:
    records = [RequestRecord(ok=True, num_output_tokens=300), RequestRecord(ok=True, num_output_tokens=100),
               RequestRecord(ok=False, num_output_tokens=50)]
    # pid a: +1.5 s; b: new, 0.5 s; c gone: 2 s over 400 tokens in 4 s. No such pids exist (above
    # Linux's largest pid), so their CPU goes to the role "other".
    a, b, c = 10**8, 10**8 + 1, 10**8 + 2
    figures = sf.server_cpu_figures({a: 1.0, c: 3.0}, {a: 2.5, b: 0.5}, records, duration_s=4.0)
    assert figures == {"server_cpu_s": 2.0, "server_cpu_cores": 0.5, "server_num_processes": 2,
                       "server_cpu_us_per_token": 5000.0, "server_cpu_us_per_token_other": 5000.0}


def test_stall_check_against_the_fake_server(fake_server) -> None:
    server, url = fake_server
    server.fail_prompt_len = 8192 - len(b'{"prompt": "", "max_tokens": 1, "temperature": 0.0, "stream": false, '
                                        b'"model": "m"}')  # the text prompt is refused, as tandem refuses it
    without = [BenchRequest([7] * 4, 4)] * 3
    with_stall = [BenchRequest([8] * 4, 4)] * 3
    figures = sf.run_stall_check(url, without, with_stall, model="m", slo_ttft_ms=1000.0, slo_tpot_ms=1000.0,
                                 body_bytes=8192, after_s=0.05)
    # Text prompts by their length, token prompts by their token: the passes one after the other.
    sent = [len(b["prompt"]) if isinstance(b["prompt"], str) else b["prompt"][0] for b in server.bodies]
    assert sent[:3] == [7, 7, 7] and sorted(sent[3:]) == [8, 8, 8, server.fail_prompt_len]
    assert (figures["stall_off_num_completed"], figures["stall_on_num_completed"]) == (3, 3)
    assert (figures["stall_streams"], figures["stall_body_bytes"], figures["stall_prompt_bytes"]) == (
        3, 8192, server.fail_prompt_len)
    assert figures["stall_request_status"] == 400 and "too long" in figures["stall_request_error"]
    assert figures["stall_itl_p99_ratio"] == pytest.approx(figures["stall_on_itl_p99_ms"]
                                                           / figures["stall_off_itl_p99_ms"])
    assert figures["stall_on_itl_max_ms"] >= figures["stall_on_itl_p99_ms"]
    assert figures["stall_itl_max_ratio"] == pytest.approx(figures["stall_on_itl_max_ms"]
                                                           / figures["stall_off_itl_max_ms"])
    assert figures["stall_request_s"] >= 0.0 and figures["stall_overlapped"] in (True, False)


FIGURES = {"load_levels": "conc4", "num_requests": 4, "slo_ttft_ms": 100.0, "slo_tpot_ms": 10.0, "url": "u",
           "compare_concurrency": 4, "server_cpu_us_per_token": 812.34, "server_cpu_s": 3.25,
           "server_cpu_cores": 1.5, "server_num_processes": 17, "simulated_step_base_ms": 5.9,
           "simulated_step_per_seq_ms": 0.01, "single_stream_itl_ratio": 1.0512, "single_stream_itl_p50_ms": 6.213,
           "stall_itl_p99_ratio": 3.5, "stall_streams": 32, "stall_on_itl_p99_ms": 70.0,
           "stall_off_itl_p99_ms": 20.0, "stall_on_itl_max_ms": 900.0, "stall_off_itl_max_ms": 25.0,
           "stall_itl_max_ratio": 36.0,
           "stall_prompt_bytes": 8384400, "stall_request_status": 400, "stall_request_s": 1.234,
           "stall_overlapped": True, "stall_on_num_failed": 0}


def test_the_summary_prints_each_served_path_figure() -> None:
    assert served_path_lines(FIGURES) == [
        "server_cpu_us_per_token 812.3 (server process tree: 3.25 CPU s, 1.50 cores on average, 17 processes, "
        "at 4 in flight)",
        "single_stream_itl_ratio 1.051 (ITL p50 6.21 ms, one stream at a time, over the simulated step of one "
        "sequence, 5.91 ms)",
        "stall_itl_p99_ratio 3.500 (ITL p99 of 32 streams 70.0 ms with a 8384400-byte text prompt arriving vs "
        "20.0 ms without; ITL max 900.0 vs 25.0 ms, x36.00; the prompt's answer: HTTP 400 after 1.23 s)"]
    assert served_path_lines({"load_levels": "conc4"}) == []
    out = io.StringIO()
    print_serve_table(FIGURES, file=out)
    rows = [line.split()[0] for line in out.getvalue().splitlines()[2:]]
    assert rows == ["conc4", "stall_on", "server_cpu_us_per_token", "single_stream_itl_ratio", "stall_itl_p99_ratio"]
