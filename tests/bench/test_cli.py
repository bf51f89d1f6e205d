"""`tandem bench`'s parser (every command registered, what it takes from the router as hooks),
and `tandem bench offline | latency | spec | overlap` end to end through the `tandem` entry
point, on a tiny model with the smallest settings: exit code 0 and the documented JSON figures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tandem.bench.bench_models import BENCH_SHAPES
from tandem.bench.cli import register
from tandem.bench.report import sweep_batches
from tandem.bench.workload import OFFLINE_QUICK, make_workload
from tandem.cli.main import main
from tandem.workers.cache_dir import cache_dir
from tests.bench.conftest import PNG_MAGIC, TINY_SHAPE, bench
from tests.conftest import tiny_model

SMALLEST = ["--quick", "--repeats", "1", "--idle-wait", "0"]


@pytest.mark.slow
def test_offline(tmp_path: Path) -> None:
    plot = tmp_path / "offline.png"
    fig = bench(tmp_path, "offline", "--model", tiny_model(), "--device", "cpu", "--num-requests", "3",
                "--plot", str(plot), "--max-mixed-graph-tokens", "64", *SMALLEST)
    requests = make_workload(replace(OFFLINE_QUICK, num_requests=3), 512)
    assert (fig["num_requests"], fig["repeats"], fig["quick"], fig["device"]) == (3, 1, True, "cpu")
    assert fig["num_output_tokens"] == sum(r.output_len for r in requests)
    assert fig["max_mixed_graph_tokens"] == 64  # an engine option, as the run used it
    for key in ("gpu_busy", "gpu_busy_unprofiled", "gpu_kernels", "gpu_kernel_table", "gpu_idle_edges_ms",
                "gpu_largest_gaps", "gpu_gaps_200us_2ms_count", "gpu_gap_ms_under_launch", "gpu_largest_gaps_host",
                "gpu_host_clock", "gpu_alloc_retries", "gpu_runtime_calls", "gpu_largest_gaps_calls", "gpu_host_syncs",
                "gpu_host_sync_sites"):
        assert fig[key] is None, key  # measured on CUDA only
    for key in ("tandem_output_tok_s", "hf_static_output_tok_s", "hf_sequential_output_tok_s", "mfu",
                "peak_matmul_flops", "model_flops", "wall_s", "process_cpu_share"):
        assert fig[key] > 0, key
    assert fig["throughput_ratio_vs_hf_static"] == pytest.approx(
        fig["tandem_output_tok_s"] / fig["hf_static_output_tok_s"])
    # One repeat: its longest collection is part of its total.
    assert 0 <= fig["host_gc_longest_ms"] <= fig["host_gc_ms"] and fig["host_gc_oldest_collections"] >= 0
    assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_latency_on_a_bench_model_with_hf_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--bench-model's path (built into the model cache) and transformers' compiled fast path on CPU."""
    monkeypatch.setitem(BENCH_SHAPES, TINY_SHAPE.name, TINY_SHAPE)
    plot = tmp_path / "latency.png"
    fig = bench(tmp_path, "latency", "--bench-model", TINY_SHAPE.name, "--device", "cpu", "--sweep-batches", "1,2",
                "--hf-compiled", "--plot", str(plot), *SMALLEST)
    assert fig["model"] == str(cache_dir() / TINY_SHAPE.cache_name)
    assert (fig["prompt_len"], fig["output_len"], fig["repeats"]) == (128, 32, 1)
    assert sweep_batches(fig) == [1, 2]
    for b in (1, 2):
        assert fig[f"sweep_b{b}_tok_s"] == pytest.approx(b / fig[f"sweep_b{b}_tpot_ms"] * 1e3)
    for key in ("tpot_tandem_ms", "tpot_hf_ms", "tpot_hf_compiled_ms", "mbu", "engine_overhead", "bare_forward_ms"):
        assert fig[key] > 0, key
    assert fig["tpot_ratio_vs_hf"] == pytest.approx(fig["tpot_tandem_ms"] / fig["tpot_hf_ms"])
    assert fig["tpot_ratio_vs_hf_compiled"] == pytest.approx(fig["tpot_tandem_ms"] / fig["tpot_hf_compiled_ms"])
    assert fig["hf_compiled_error"] is None
    assert fig["decode_tok_s_at_128"] is None  # the CPU sweep stops below 128
    for b in (1, 2):  # profiled replays are CUDA's (the profiler's CUDA activity)
        names = ("gpu_busy", "kernels_per_pass", "mean_gap_us", "kernel_table", "profiler_slowdown",
                 "gpu_busy_unprofiled")
        assert [fig[f"replay_b{b}_{name}"] for name in names] == [None] * 6
    assert fig["arrivals_step_ms"] is None and fig["arrivals_mixed_graph_speedup"] is None  # CUDA graphs only
    assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_latency_with_multi_step_decoding_reports_per_token_figures(tmp_path: Path) -> None:
    fig = bench(tmp_path, "latency", "--model", tiny_model(), "--device", "cpu", "--sweep-batches", "1,2",
                "--num-scheduler-steps", "4", *SMALLEST)
    assert fig["num_scheduler_steps"] == 4
    # A step of four passes gives four tokens: the figures are per pass, as without it.
    for key in ("tpot_tandem_ms", "bare_forward_ms", "engine_overhead", "sweep_b2_tpot_ms"):
        assert 0 < fig[key] < 1e3, key
    assert fig["tpot_ratio_vs_hf"] == pytest.approx(fig["tpot_tandem_ms"] / fig["tpot_hf_ms"])


@pytest.mark.slow
def test_latency_without_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-hf: transformers is never loaded, its figures are null, tandem's are all there."""
    import tandem.bench.systems as systems

    def refuse(*args: object) -> None:
        raise AssertionError("transformers loaded")
    monkeypatch.setattr(systems, "load_hf_model", refuse)
    plot = tmp_path / "latency.png"
    fig = bench(tmp_path, "latency", "--model", tiny_model(), "--device", "cpu", "--sweep-batches", "1,2",
                "--no-hf", "--plot", str(plot), *SMALLEST)
    for key in ("tpot_hf_ms", "tpot_ratio_vs_hf", "tpot_hf_ms_repeats", "hf_mbu", "tpot_hf_compiled_ms",
                "tpot_ratio_vs_hf_compiled", "hf_compiled_error"):
        assert fig[key] is None, key
    for key in ("tpot_tandem_ms", "mbu", "engine_overhead", "bare_forward_ms", "sweep_b2_tok_s"):
        assert fig[key] > 0, key
    assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_offline_without_transformers(tmp_path: Path) -> None:
    """--no-hf: tandem alone (a second run of the set under another engine option): every
    baseline figure null, the plot and the table without them."""
    plot = tmp_path / "offline.png"
    fig = bench(tmp_path, "offline", "--model", tiny_model(), "--device", "cpu", "--num-requests", "3",
                "--no-hf", "--plot", str(plot), *SMALLEST)
    assert fig["tandem_output_tok_s"] > 0 and fig["mfu"] > 0
    for key in ("hf_static_output_tok_s", "hf_sequential_output_tok_s", "throughput_ratio_vs_hf_static",
                "throughput_ratio_vs_hf_sequential", "hf_static_mfu", "hf_static_generated_tokens",
                "hf_static_useful_fraction"):
        assert fig[key] is None, key
    assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_tandem_sampling_at_a_temperature(tmp_path: Path) -> None:
    """--temperature: tandem's requests sample (seeded), still to their exact lengths."""
    fig = bench(tmp_path, "offline", "--model", tiny_model(), "--device", "cpu", "--num-requests", "3",
                "--temperature", "0.8", "--no-hf-sequential", *SMALLEST)
    requests = make_workload(replace(OFFLINE_QUICK, num_requests=3), 512)
    assert (fig["temperature"], fig["num_output_tokens"]) == (0.8, sum(r.output_len for r in requests))
    assert fig["tandem_output_tok_s"] > 0
    fig = bench(tmp_path, "latency", "--model", tiny_model(), "--device", "cpu", "--sweep-batches", "1,2",
                "--no-hf", "--temperature", "1.0", *SMALLEST)
    assert fig["temperature"] == 1.0
    for key in ("tpot_tandem_ms", "engine_overhead", "sweep_b2_tok_s"):
        assert fig[key] > 0, key


def test_model_and_bench_model_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("offline", "latency", "serve", "spec", "prefix", "overlap"):
        assert main(["bench", command, "--model", "m", "--bench-model", "llama-1b"]) == 2, command
        assert "--model and --bench-model" in capsys.readouterr().err


@pytest.mark.slow
def test_spec(tmp_path: Path) -> None:
    fig = bench(tmp_path, "spec", "--model", tiny_model(), "--num-speculative-tokens", "2", *SMALLEST)
    assert (fig["proposer"], fig["num_speculative_tokens"], fig["repeats"], fig["quick"]) == ("ngram", 2, 1, True)
    for key in ("tpot_speedup", "saturation_throughput_ratio", "tpot_plain_ms", "tpot_spec_ms", "ngram_tpot_speedup"):
        assert fig[key] > 0, key
    assert 0.0 <= fig["acceptance_rate"] <= 1.0


@pytest.mark.slow
def test_overlap(tmp_path: Path) -> None:
    fig = bench(tmp_path, "overlap", "--model", tiny_model(), "--num-tokens", "64", "--repeats", "1")
    # Chunked GEMMs may round differently in the last bits (MKL blocks by shape); the greedy
    # tokens are what must not change, and tests/distributed checks those.
    assert fig["max_abs_diff_serial_vs_overlap"] < 1e-3
    assert (fig["tp"], fig["num_tokens"], fig["num_chunks"], fig["repeats"]) == (2, 64, 2, 1)
    for mode in ("serial", "overlap", "compute", "compute_chunked", "serial_gloo", "overlap_gloo"):
        assert fig[f"t_{mode}_ms"] > 0 and fig[f"cpu_ms_per_rank_{mode}"] > 0
    for key in ("hidden_fraction", "hidden_fraction_gloo", "serial_step_speedup_shm_vs_gloo",
                "comm_time_removed_vs_gloo"):
        assert key in fig


@pytest.mark.slow
def test_single_process_benchmarks_never_import_ray(tmp_path: Path) -> None:
    """TP = PP = 1: `offline` and `spec` run without Ray (GPU machines without it exist)."""
    import subprocess
    import sys

    model = tiny_model()
    script = (
        "import sys\n"
        "from tandem.cli.main import main\n"
        f"assert main(['bench', 'offline', '--model', {model!r}, '--num-requests', '2', '--no-hf-sequential',"
        " '--quick', '--repeats', '1', '--idle-wait', '0']) == 0\n"
        f"assert main(['bench', 'spec', '--model', {model!r}, '--num-speculative-tokens', '2',"
        " '--quick', '--repeats', '1', '--idle-wait', '0']) == 0\n"
        "print('ray imported:', sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))[:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ray imported: []" in done.stdout


def test_cli_registers_every_bench_command() -> None:
    from tandem.cli.main import build_parser

    args = build_parser().parse_args(["bench", "offline", "--quick", "--output-json", "x.json", "--repeats", "2",
                                      "--device", "cpu", "--max-num-seqs", "8", "--num-requests", "5"])
    assert (args.bench_command, args.quick, args.output_json, args.repeats, args.device) == (
        "offline", True, "x.json", 2, "cpu")
    assert (args.max_num_seqs, args.num_requests, args.bench_model) == (8, 5, None)
    args = build_parser().parse_args(["bench", "latency", "--bench-model", "llama-8b", "--hf-compiled",
                                      "--sweep-batches", "1,128"])
    assert (args.bench_model, args.hf_compiled, args.sweep_batches) == ("llama-8b", True, "1,128")
    for command in ("overlap", "serve", "spec", "prefix"):
        args = build_parser().parse_args(["bench", command, "--bench-model", "llama-1b", "--quick"])
        assert (args.bench_command, args.bench_model, args.quick) == (command, "llama-1b", True)
    assert build_parser().parse_args(["bench", "spec"]).num_speculative_tokens == 12
    args = build_parser().parse_args(["bench", "serve", "--concurrency", "128", "--compare-concurrency", "128",
                                      "--num-requests", "256", "--output-len", "256", "--prompt-len", "64",
                                      "--no-stall-check"])
    assert (args.concurrency, args.compare_concurrency, args.num_requests) == ("128", 128, 256)
    assert (args.output_len, args.prompt_len, args.stall_check) == (256, 64, False)
    args = build_parser().parse_args(["bench", "serve"])
    assert (args.output_len, args.prompt_len, args.stall_check) == (None, None, True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "offline", "--bench-model", "llama-70b"])


def test_register_takes_what_it_needs_from_the_router_as_hooks() -> None:
    import argparse

    from tandem.bench.cli import RouterHooks

    def add_engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model")
        p.add_argument("--dtype", default="auto")

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"), RouterHooks(add_engine_args, vars, lambda options: None))
    args = parser.parse_args(["bench", "latency", "--plot", "l.png", "--model", "m"])
    assert (args.bench_command, args.plot, args.repeats, args.model) == ("latency", "l.png", None, "m")
