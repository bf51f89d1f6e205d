"""`tandem bench serve | prefix` end to end through the `tandem` entry point: Ray Serve on this
machine (one Ray for the module, free ports), a tiny model, the smallest workloads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cluster.local_ray import start_local_ray, stop_local_ray
from tests.bench.conftest import bench
from tests.conftest import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # a Serve application on Ray: not in the fast loop


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One Ray for both benchmarks: each starts (and shuts down) its own Serve in it."""

    cores = os.cpu_count() or 1
    # Logical CPUs for prefix's two apps of two groups, each group with half the cores.
    start_local_ray(address="local", num_cpus=2 * cores + 4, include_dashboard=False, log_to_driver=False)
    yield
    stop_local_ray()


def test_serve(local_ray: None, tmp_path: Path) -> None:
    fig = bench(tmp_path, "serve", "--model", tiny_model(), "--quick", "--num-requests", "3", "--request-rates", "inf",
                "--compare-concurrency", "2", "--no-stall-check")
    assert (fig["num_requests"], fig["load_levels"], fig["compare_concurrency"]) == (3, "rateinf", 2)
    assert fig["url"].startswith("http://127.0.0.1:") and fig["model"] == tiny_model()
    for level in ("rateinf", "conc2"):
        assert (fig[f"{level}_num_completed"], fig[f"{level}_num_failed"]) == (3, 0)
        for key in ("ttft_p50_ms", "tpot_p50_ms", "e2e_p99_ms", "output_tok_s", "goodput_req_s"):
            assert fig[f"{level}_{key}"] > 0, f"{level}_{key}"
    assert fig["server_vs_offline_throughput"] == pytest.approx(
        fig["server_output_tok_s"] / fig["offline_output_tok_s"])
    # The served path: the server's processes (Ray's, Serve's, the replicas') took CPU for the level's tokens.
    assert fig["server_cpu_us_per_token"] > 0 and fig["server_num_processes"] >= 3
    # The stall check (tests/bench/test_serve_figures.py) costs this test seconds of tokenizing
    # 8 MiB; there is no simulated step for a single-stream level.
    assert not any(key.startswith(("stall_", "single_stream")) for key in fig)


def test_prefix(local_ray: None, tmp_path: Path) -> None:
    fig = bench(tmp_path, "prefix", "--model", tiny_model(), "--quick", "--repeats", "1", "--idle-wait", "0",
                "--num-prefixes", "2", "--prefix-len", "32", "--suffix-len", "8", "--num-requests", "4",
                "--num-no-share", "2", "--num-hit-pairs", "1", "--request-rate", "50")
    assert (fig["num_prefixes"], fig["prefix_len"], fig["suffix_len"], fig["repeats"]) == (2, 32, 8, 1)
    assert fig["routed_num_failed"] == fig["load_only_num_failed"] == fig["no_share_routed_num_failed"] == 0
    # A hit finds the whole prefix (two 16-token blocks), or nothing where the router had not yet
    # heard where the cold request left it (it publishes in the background).
    assert fig["hit_pair_min_cached_tokens"] in (0, 32)
    for name in ("routed_ttft_ratio", "hit_ttft_ratio", "no_share_overhead"):
        assert isinstance(fig[name], float), name
        assert fig[f"{name}_met"] in (True, False)
    assert fig["routed_ttft_ratio"] == pytest.approx(fig["routed_ttft_p50_ms"] / fig["load_only_ttft_p50_ms"])


def test_observability(local_ray: None, tmp_path: Path) -> None:
    # Two apps in one Ray, one tracing through its own env_vars: every request it served left its
    # six spans, and the other none (its requests would have added to the count).
    fig = bench(tmp_path, "observability", "--model", tiny_model(), "--quick", "--num-requests", "3")
    assert (fig["rounds"], fig["num_requests"], fig["concurrency"]) == (2, 3, 8)
    assert fig["spans_per_request"] == 6.0
    assert fig["telemetry_spans_per_request"] == 6.0  # the code's own cost was measured on real spans
    for r in range(2):
        assert fig[f"round{r}_on_output_tok_s"] > 0 and fig[f"round{r}_off_output_tok_s"] > 0
    ratios = [fig[f"round{r}_on_output_tok_s"] / fig[f"round{r}_off_output_tok_s"] for r in range(2)]
    assert fig["observability_throughput_ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two
    assert 0 < fig["telemetry_cpu_share"] < 1
