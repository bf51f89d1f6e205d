"""The transformers baselines: left padding, and static batches counting only the tokens asked for."""

from __future__ import annotations

import pytest
import torch

from tandem.bench import hf_baseline
from tandem.bench.workload import BenchRequest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tandem.workers.model.demo_model import create_model_dir
    return create_model_dir(tmp_path_factory.mktemp("bench-model"), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


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
