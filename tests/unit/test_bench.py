"""Tests for tandem.bench's pieces on a tiny model (tests/bench runs the commands end to end)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.bench import hf_baseline, latency, report
from tandem.bench.cli import register
from tandem.bench.systems import BenchOptions
from tandem.bench.workload import BenchRequest, WorkloadSpec, fixed_length_requests, make_workload
from tandem.workers.model.cost import ModelCost

TINY_OFFLINE = WorkloadSpec(num_requests=5, prompt_len=(6, 20), output_len=(3, 7), seed=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tandem.workers.model.demo_model import create_model_dir
    return create_model_dir(tmp_path_factory.mktemp("bench-model"), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


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
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "offline", "--bench-model", "llama-70b"])


def test_table_marks_targets(capsys) -> None:
    report.print_table("t", [("mbu", 0.7, ""), ("engine_overhead", 1.3, "x"), ("other", 5, "")])
    out = capsys.readouterr().out
    assert ">= 0.6  PASS" in out and "<= 1.15  FAIL" in out
    assert report.meets_target("tpot_ratio_vs_hf", 1.0) is True
    assert report.meets_target("unknown", 1.0) is None


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


def test_bench_options_take_one_model() -> None:
    with pytest.raises(ValueError, match="--model and --bench-model"):
        BenchOptions(model="m", bench_model="llama-1b")
    with pytest.raises(ValueError, match="bench_model: must be one of llama-1b, llama-8b"):
        BenchOptions(bench_model="llama-70b")
    assert BenchOptions(bench_model="llama-8b").bench_model == "llama-8b"  # built when a benchmark runs, not here


def test_hf_compiled_figures_are_null_when_not_measured() -> None:
    assert latency.hf_compiled_figures([0.02], [None], None) == {
        "tpot_hf_compiled_ms": None, "tpot_ratio_vs_hf_compiled": None, "hf_compiled_error": None}
    assert latency.hf_compiled_figures([0.02], [None], "BackendCompilerFailed: no compiler")["hf_compiled_error"] == (
        "BackendCompilerFailed: no compiler")
    assert latency.hf_compiled_figures([0.02, 0.03], [0.01, 0.02], None) == {
        "tpot_hf_compiled_ms": 15.0, "tpot_ratio_vs_hf_compiled": 1.75, "hf_compiled_error": None}


def test_latency_sweeps_to_128_on_cuda_only() -> None:
    assert latency.default_shape(True, torch.device("cpu")) == latency.LATENCY_QUICK
    assert latency.default_shape(False, torch.device("cuda")).sweep_batches == (1, 2, 4, 8, 16, 32, 64, 128)
    assert latency.default_shape(False, torch.device("cuda")).prompt_len == latency.LATENCY_FULL.prompt_len


def test_write_outputs_and_busy_warning(tmp_path, capsys) -> None:
    figures = {"mfu": 0.5, "device": "cpu", "cpu_count": 2, "load_average_1m": 0.5, "load_average_1m_end": 3.5}
    report.write_outputs(figures, str(tmp_path / "f.json"), str(tmp_path / "f.png"), None)
    assert json.loads((tmp_path / "f.json").read_text()) == figures
    assert not (tmp_path / "f.png").exists()
    err = capsys.readouterr().err
    assert f"wrote {tmp_path / 'f.json'}" in err and "no plot for this benchmark" in err
    report.warn_if_busy(figures)
    assert "load average 3.5 on 2 cores: other processes" in capsys.readouterr().err
    report.warn_if_busy({**figures, "load_average_1m_end": 1.0, "process_cpu_share": 0.5})
    assert "this process got 50% of its threads' CPU time" in capsys.readouterr().err
    report.warn_if_busy({**figures, "device": "cuda"})
    report.warn_if_busy({**figures, "load_average_1m_end": 1.0})
    assert capsys.readouterr().err == ""


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
