"""`python -m tandem.bench.host_step` times the host's share of a decode step (the model's
work replaced by zeros), on CPU set up as on CUDA."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tandem.bench import host_step
from tandem.workers import SamplingParams
from tandem.workers.runner.model_runner import ModelRunner


@pytest.mark.parametrize(("kind", "temperature"), [("final", "0"), ("delta", "0"), ("final", "1.0")])
def test_reports_host_time_per_batch(llama_dir: str, tmp_path: Path, monkeypatch, capsys, kind: str,
                                     temperature: str) -> None:
    graph_mode = ModelRunner._graph_mode
    out = tmp_path / "host.json"
    thaw = ["--thaw-startup-heap"] if kind == "delta" else []  # the A/B's other arm, on one case
    monkeypatch.setattr(sys, "argv", ["host_step", llama_dir, "--batches", "1,3", "--repeats", "1",
                                      "--prompt-len", "20", "--max-tokens", "9", "--output-kind", kind,
                                      "--temperature", temperature, "--output-json", str(out), *thaw])
    host_step.main()
    assert ModelRunner._graph_mode is graph_mode  # the CUDA-like set-up does not leak
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch")]
    assert [line.split(":")[0] for line in lines] == ["batch    1", "batch    3"]
    figures = json.loads(out.read_text())
    assert (figures["output_kind"], figures["temperature"]) == (kind, float(temperature))
    assert figures["startup_heap_frozen"] is not thaw
    assert [r["batch"] for r in figures["results"]] == [1, 3]
    for r in figures["results"]:
        assert r["host_ms_per_step"] > 0
        # Both figures are rounded (to a token a second, to 0.1 us): a slow step's few hundred
        # tokens a second are off by up to half a token.
        assert r["max_tok_s"] == pytest.approx(r["batch"] * 1e3 / r["host_ms_per_step"], rel=1e-3, abs=0.51)
        assert r["host_ms_per_step_mean"] > 0 and r["gc_ms_per_step"] >= 0 and r["gc_oldest_collections"] >= 0


def test_graph_buckets_and_kernel_tables_on_cpu(llama_dir: str) -> None:
    """The measured engine takes CUDA's host path: decode steps padded into the graph buffer,
    the Triton backend's tables, steps scheduled ahead of their tokens."""
    llm = host_step._cuda_like_llm(llama_dir, "cpu", 4, max_context=25)
    assert llm.engine.pool.num_blocks == 4 * 3  # 25 tokens: two blocks of 16, and one for the step ahead
    token = host_step.null_model(llm)
    # A plain text token: a skipped special one would grow streaming's detokenizer window.
    assert token not in llm.tokenizer.all_special_ids and llm.tokenizer.decode([token]).strip()
    runner = llm.engine.executor.runner
    assert runner.graphs is not None and runner.builder.kernel_tables and llm.engine.overlap_steps
    seen = []
    build = runner.builder.build

    def spy(out, states, table, graph=None, source=None, **kwargs):
        inputs = build(out, states, table, graph, source, **kwargs)
        seen.append((inputs.graph_batch, inputs.pending_dst is not None))
        return inputs

    runner.builder.build = spy
    host_step.measure(llm, 3, 1, "final", prompt_len=20, max_tokens=5)
    assert llm.engine.scheduler.num_preemptions == 0  # every step holds the whole batch
    assert seen[0] == (None, False)  # the prefill
    assert seen[-1] == (4, True)  # 3 decodes pad to the bucket of 4, their tokens still on the device
    [out] = llm.generate([{"prompt_token_ids": list(range(10, 30))}],
                         SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == [token] * 3
    llm.shutdown()
