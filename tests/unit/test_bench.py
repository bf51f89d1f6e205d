"""Tests for tandem.bench: the pieces on a tiny model, and the JSON/plot outputs of both benchmarks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tandem.bench import hf_baseline, latency, offline, report
from tandem.bench.cli import register
from tandem.bench.model_cost import ModelCost
from tandem.bench.systems import BenchOptions
from tandem.bench.workload import BenchRequest, WorkloadSpec, fixed_length_requests, make_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_OFFLINE = WorkloadSpec(num_requests=5, prompt_len=(6, 20), output_len=(3, 7), seed=3)
TINY_LATENCY = latency.LatencyShape(prompt_len=12, output_len=5, sweep_prompt_len=8, sweep_output_len=4,
                                    sweep_batches=(1, 2, 4))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tandem.workers.model.demo_model import create_model_dir
    return create_model_dir(tmp_path_factory.mktemp("bench-model"), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def _opts(tiny_dir: str) -> BenchOptions:
    return BenchOptions(model=tiny_dir, device="cpu", repeats=1, show_progress=False, idle_wait_s=0)


def test_workload_is_seeded_and_in_range() -> None:
    a = make_workload(TINY_OFFLINE, vocab_size=100)
    assert a == make_workload(TINY_OFFLINE, vocab_size=100)
    assert a != make_workload(WorkloadSpec(5, (6, 20), (3, 7), seed=4), vocab_size=100)
    assert len(a) == 5
    for r in a:
        assert 6 <= len(r.prompt_token_ids) <= 20 and 3 <= r.output_len <= 7
        assert all(5 <= t < 100 for t in r.prompt_token_ids)  # no special tokens
    same = fixed_length_requests(3, 4, 2, vocab_size=100)
    assert [(len(r.prompt_token_ids), r.output_len) for r in same] == [(4, 2)] * 3


def test_model_cost_counts() -> None:
    cost = ModelCost(num_layers=2, hidden_size=8, num_kv_heads=2, head_dim=4, non_embedding_params=1000,
                     lm_head_params=100, itemsize=4)
    # prompt 3, output 2: 4 tokens processed (contexts 1..4, sum 10), 2 logits rows
    assert cost.request_flops(3, 2) == 2 * 1000 * 4 + 2 * 2 * 2 * 8 * 10 + 2 * 100 * 2
    assert cost.request_flops(3, 2, lm_head_every_token=True) == 2 * 1000 * 4 + 2 * 2 * 2 * 8 * 10 + 2 * 100 * 4
    assert cost.decode_step_flops(batch=3, context_len=5) == 3 * (2 * 1100 + 2 * 2 * 2 * 5 * 8)
    assert cost.weight_bytes == 1100 * 4
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert cost.decode_step_bytes(batch=2, context_len=10) == 4400 + 2 * 10 * 128
    # ridge 4 FLOP/byte: B * 2264 >= 4 * (4400 + 128 B) first holds at B = 11
    assert cost.roofline_crossover_batch(1, peak_flops=4.0, peak_bytes_per_s=1.0) == 11.0


def test_model_cost_from_tandem_model(tiny_dir) -> None:
    from tandem.workers.llm import LLM
    llm = LLM(model=tiny_dir, device="cpu")
    cost = ModelCost.from_tandem_model(llm.engine.executor.runner.model, itemsize=4)
    # per layer: qkv 64 x (64 + 2*32), o 64x64, gate|up 64 x 256, down 128x64, two norms; final norm
    per_layer = 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64
    assert cost.non_embedding_params == 2 * per_layer + 64
    assert cost.lm_head_params == 512 * 64
    assert (cost.num_layers, cost.hidden_size, cost.num_kv_heads, cost.head_dim) == (2, 64, 2, 16)


def test_left_pad() -> None:
    ids, mask = hf_baseline.left_pad([[7, 8, 9], [5]], pad_id=2, device=torch.device("cpu"))
    assert ids.tolist() == [[7, 8, 9], [2, 2, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hf_static_counts_only_requested_tokens(tiny_dir) -> None:
    from tandem.bench.systems import load_hf_model
    model = load_hf_model(tiny_dir, torch.float32, torch.device("cpu"))
    requests = [BenchRequest([10, 11, 12], 2), BenchRequest([13], 5), BenchRequest([14, 15], 3)]
    run = hf_baseline.run_static(model, requests, torch.device("cpu"), batch_size=2, show_progress=False)
    assert run.num_output_tokens == 10
    assert run.num_generated_tokens == 2 * 5 + 1 * 3  # batch of two runs to 5; the last batch to 3
    seq = hf_baseline.run_sequential(model, requests, torch.device("cpu"), show_progress=False)
    assert seq.num_output_tokens == seq.num_generated_tokens == 10


def test_offline_figures_json_and_plot(tiny_dir, tmp_path) -> None:
    fig = offline.run_offline(_opts(tiny_dir), spec=TINY_OFFLINE)
    for key in ("throughput_ratio_vs_hf_static", "throughput_ratio_vs_hf_sequential", "mfu",
                "tandem_output_tok_s", "hf_static_output_tok_s", "hf_sequential_output_tok_s",
                "peak_matmul_flops", "model_flops"):
        assert isinstance(fig[key], (int, float)) and fig[key] > 0, key
    assert fig["num_output_tokens"] == sum(r.output_len for r in make_workload(TINY_OFFLINE, 512))
    assert math.isclose(fig["throughput_ratio_vs_hf_static"],
                        fig["tandem_output_tok_s"] / fig["hf_static_output_tok_s"])
    path = tmp_path / "offline.json"
    report.write_json(str(path), fig)
    loaded = json.loads(path.read_text())
    assert loaded["mfu"] == fig["mfu"]
    assert not any(isinstance(v, dict) for v in loaded.values())
    report.plot_offline(str(tmp_path / "offline.png"), fig)
    assert (tmp_path / "offline.png").read_bytes()[:8] == PNG_MAGIC
    report.print_table(offline.title(fig), offline.table_rows(fig))


def test_latency_figures_json_and_plot(tiny_dir, tmp_path) -> None:
    fig = latency.run_latency(_opts(tiny_dir), shape=TINY_LATENCY)
    for key in ("tpot_ratio_vs_hf", "mbu", "engine_overhead", "tpot_tandem_ms", "tpot_hf_ms",
                "copy_bandwidth_bytes_s", "bare_forward_ms"):
        assert isinstance(fig[key], float) and fig[key] > 0, key
    assert report.sweep_batches(fig) == [1, 2, 4]
    for b in (1, 2, 4):
        assert fig[f"sweep_b{b}_tok_s"] == pytest.approx(b / fig[f"sweep_b{b}_tpot_ms"] * 1e3)
    path = tmp_path / "latency.json"
    report.write_json(str(path), fig)
    assert set(json.loads(path.read_text())) == set(fig)
    report.plot_latency(str(tmp_path / "latency.png"), fig)
    assert (tmp_path / "latency.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_registers_bench_commands(capsys) -> None:
    from tandem.router.cli import build_parser
    args = build_parser().parse_args(["bench", "offline", "--quick", "--output-json", "x.json", "--repeats", "2",
                                      "--device", "cpu", "--max-num-seqs", "8"])
    assert (args.benchmark, args.quick, args.output_json, args.repeats, args.device) == ("offline", True, "x.json", 2,
                                                                                         "cpu")
    assert args.max_num_seqs == 8
    args = build_parser().parse_args(["bench", "overlap", "--quick"])
    try:
        import tandem.bench.overlap  # noqa: F401
    except ModuleNotFoundError:
        assert args.func(args) == 1
        assert "not available" in capsys.readouterr().err


def test_table_marks_targets(capsys) -> None:
    report.print_table("t", [("mbu", 0.7, ""), ("engine_overhead", 1.3, "x"), ("other", 5, "")])
    out = capsys.readouterr().out
    assert ">= 0.6  PASS" in out and "<= 1.15  FAIL" in out
    assert report.meets_target("tpot_ratio_vs_hf", 1.0) is True
    assert report.meets_target("unknown", 1.0) is None


def test_register_is_standalone() -> None:
    import argparse
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")

    def add_engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model")
        p.add_argument("--dtype", default="auto")

    register(sub, add_engine_args)
    args = parser.parse_args(["bench", "latency", "--plot", "l.png"])
    assert (args.benchmark, args.plot, args.repeats) == ("latency", "l.png", None)


def test_contention_log_runs_once_when_told_not_to_wait() -> None:
    from tandem.bench.hardware import ContentionLog, CpuMonitor
    calls = []
    log = ContentionLog(max_wait_s=0, max_attempts=1)
    assert log.run(lambda: calls.append(1) or 7, torch.device("cpu")) == 7
    assert calls == [1] and log.figures()["contention_runs"] == 1
    assert log.figures()["contention_runs_redone"] == 0
    with CpuMonitor() as monitor:
        sum(range(10 ** 5))
    assert monitor.foreign_fraction is None or monitor.foreign_fraction >= 0.0
