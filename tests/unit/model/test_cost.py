"""ModelCost: a model's FLOPs and bytes, from its config and from a loaded model."""

from __future__ import annotations

import pytest

from tandem.workers.model.cost import ModelCost
from tandem.workers.model.hf_config import HFModelConfig


@pytest.fixture
def tiny_dir() -> str:
    from tests.conftest import tiny_model

    return tiny_model("llama")


def test_model_cost_from_config_counts_what_the_model_holds(tiny_dir) -> None:
    cost = ModelCost.from_hf_config(HFModelConfig.from_dir(tiny_dir), itemsize=4)
    # the figures test_model_cost_from_tandem_model counts from the loaded tandem model
    per_layer = 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64
    assert cost == ModelCost(num_layers=2, hidden_size=64, num_kv_heads=2, head_dim=16,
                             non_embedding_params=2 * per_layer + 64, lm_head_params=512 * 64, itemsize=4,
                             linear_params=2 * (per_layer - 2 * 64), embedding_params=512 * 64)


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


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_config_and_model_count_the_same_bytes(arch) -> None:
    from tandem.workers.llm import LLM
    from tests.conftest import tiny_model

    path = tiny_model(arch)
    llm = LLM(model=path, device="cpu")
    held = ModelCost.from_tandem_model(llm.engine.executor.runner.model, itemsize=4)
    llm.shutdown()
    counted = ModelCost.from_hf_config(HFModelConfig.from_dir(path), itemsize=4)
    # qwen2's q/k/v biases included; what the engine's MBU divides is the same from either
    assert (counted.non_embedding_params, counted.lm_head_params, counted.weight_bytes) == (
        held.non_embedding_params, held.lm_head_params, held.weight_bytes)
    assert counted.kv_bytes_per_token == held.kv_bytes_per_token
