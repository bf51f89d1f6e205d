"""DeploymentPlan on published models' configs, against how they are deployed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tandem.workers.device_specs import GPU_SPECS, DeviceSpec
from tandem.workers.model.cost import ModelCost
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.plan import (
    BLOCK_SIZE,
    RESERVE_BYTES,
    DeploymentPlan,
    PlanRequest,
    layout_sizes,
    tensor_parallel_sizes,
)
from tests.unit.model.published_configs import write_config

H100 = GPU_SPECS["H100-SXM-80GB"]


def request(tmp_path: Path, name: str, **changes: object) -> PlanRequest:
    cfg = HFModelConfig.from_dir(write_config(tmp_path, name))
    req = PlanRequest(cfg=cfg, device=H100, itemsize=2, weight_itemsize=None, kv_itemsize=None, fp8_matmuls=False,
                      gpus_per_node=8, num_nodes=1, max_model_len=cfg.max_position_embeddings, context_len=1024,
                      concurrency=64, gpu_memory_utilization=0.9)
    return replace(req, **changes)


def layout_of(plan: DeploymentPlan) -> tuple[int, int]:
    return plan.shown.tensor_parallel_size, plan.shown.pipeline_parallel_size


@pytest.mark.parametrize(("name", "num_params", "kv_bytes_per_token"), [
    ("Llama-3-8B", 8_030_261_248, 131_072),
    ("Llama-3-70B", 70_553_706_496, 327_680),
    ("Llama-3.1-405B", 405_853_388_800, 516_096),
    ("Mistral-7B", 7_241_732_096, 131_072),
    ("Qwen2-72B", 72_706_203_648, 327_680),  # q/k/v biases; untied
])
def test_weight_bytes_are_the_parameters_sizes(tmp_path, name, num_params, kv_bytes_per_token) -> None:
    plan = DeploymentPlan.make(request(tmp_path, name))
    assert plan.figures()["num_params"] == num_params
    assert plan.figures()["weight_bytes"] == 2 * num_params
    assert plan.figures()["kv_bytes_per_token"] == kv_bytes_per_token


def test_a_tied_table_is_one_tensor_in_the_checkpoint_and_two_in_the_engine(tmp_path) -> None:
    plan = DeploymentPlan.make(request(tmp_path, "Llama-3.2-1B", max_model_len=8192))
    assert plan.figures()["num_params"] == 1_235_814_400
    assert plan.figures()["weight_bytes"] == 2_471_628_800
    # the engine loads the table into its embedding and its lm_head (workers/model/llama.py)
    assert plan.layout.weight_bytes_per_gpu == 2 * (1_235_814_400 + 128256 * 2048)


def test_fp8_weights_are_one_byte_per_linear_parameter(tmp_path) -> None:
    cost = request(tmp_path, "Llama-3-8B", weight_itemsize=1, kv_itemsize=1).shard()
    linear = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    assert cost.linear_params == linear
    # embedding and lm_head (128256 x 4096 each) and the norms stay in bfloat16
    assert cost.memory_bytes == linear + 2 * (2 * 128256 * 4096 + 65 * 4096) == 9_081_200_640
    assert cost.kv_bytes_per_token == 65_536


def test_llama_405b_bf16_needs_two_nodes(tmp_path) -> None:
    plan = DeploymentPlan.make(request(tmp_path, "Llama-3.1-405B"))
    assert not plan.fits
    assert layout_of(plan) == (8, 2)
    assert plan.figures()["fits"] is False
    assert plan.suggestions[:2] == ("2 nodes of 8 GPUs fit it (--nodes 2): TP=8 x PP=2",
                                    "FP8 weights fit this cluster (--quantization fp8): TP=8 x PP=1")
    two = DeploymentPlan.make(request(tmp_path, "Llama-3.1-405B", num_nodes=2))
    assert two.fits and layout_of(two) == (8, 2) and two.layout.num_nodes == 2
    # stage 0: 63 layers and the embedding's 16032 rows; stage 1: 63 layers, the norm and the lm_head's
    stage = 63 * (16384 * (2048 + 2 * 128) + 2048 * 16384 + 3 * 16384 * 6656 + 2 * 16384) + 16032 * 16384
    assert two.layout.weight_bytes_per_gpu == 2 * (stage + 16384)


def test_llama_405b_fp8_fits_one_node(tmp_path) -> None:
    plan = DeploymentPlan.make(request(tmp_path, "Llama-3.1-405B", weight_itemsize=1, fp8_matmuls=True))
    assert plan.fits and layout_of(plan) == (8, 1)
    assert plan.min_layout == plan.layout


def test_llama_70b_fits_four_h100s_not_one(tmp_path) -> None:
    four = DeploymentPlan.make(request(tmp_path, "Llama-3-70B", gpus_per_node=4))
    assert four.fits and layout_of(four) == (4, 1)
    # TP=2 holds the weights too, but not 64 sequences of 1024 tokens: TP=4 is for the workload
    assert (four.min_layout.tensor_parallel_size, four.min_layout.batch) == (2, 28)
    assert four.layout.batch == 64
    one = DeploymentPlan.make(request(tmp_path, "Llama-3-70B", gpus_per_node=1))
    assert not one.fits
    assert one.suggestions[0] == "2 nodes of 1 GPUs fit it (--nodes 2): TP=1 x PP=2"


def test_kv_capacity_is_what_the_memory_left_holds_in_blocks(tmp_path) -> None:
    plan = DeploymentPlan.make(request(tmp_path, "Llama-3-8B", gpus_per_node=1))
    free = int(H100.memory_bytes * 0.9) - RESERVE_BYTES - 16_060_522_496
    assert plan.layout.kv_capacity_tokens == free // (131_072 * BLOCK_SIZE) * BLOCK_SIZE == 452_400
    assert plan.layout.num_max_len_seqs == 452_400 // 8192 == 55
    # batch 1 at context 1024 is memory-bound: the weights a step reads and the KV it attends to
    assert plan.layout.tpot_s == (15_009_849_344 + 1024 * 131_072) / H100.bytes_per_s


def test_a_model_too_big_for_any_cluster_of_these_cards_says_so(tmp_path) -> None:
    tiny = DeviceSpec("tiny", 2 << 30, 1e11, 1e13, None)
    plan = DeploymentPlan.make(request(tmp_path, "Llama-3.1-405B", device=tiny, gpus_per_node=1))
    assert not plan.fits and plan.min_layout is None
    assert plan.figures()["tensor_parallel_size"] is None
    assert plan.suggestions == ("the weights alone outgrow 1 node(s) of 1 x tiny: a card with more memory, "
                                "or more nodes",)


def test_a_shorter_context_is_suggested_when_only_the_kv_is_short(tmp_path) -> None:
    req = request(tmp_path, "Llama-3-8B", device=GPU_SPECS["L4"], gpus_per_node=1, max_model_len=8192,
                  gpu_memory_utilization=0.75)
    plan = DeploymentPlan.make(req)
    assert not plan.fits
    assert plan.suggestions == (
        "2 nodes of 1 GPUs fit it (--nodes 2): TP=1 x PP=2",
        "FP8 weights fit this cluster (--quantization fp8): TP=1 x PP=1",
        "a shorter context fits this cluster: --max-model-len 3376 at TP=1 x PP=1")


def test_tensor_parallel_sizes_split_the_heads() -> None:
    cfg = HFModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
                                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                                   "num_key_value_heads": 4, "vocab_size": 152064})
    assert tensor_parallel_sizes(cfg, 8) == [1, 2, 4]  # 28 heads do not split 8 ways
    # PP stages only at the widest TP (two stages of TP=4 share an 8-GPU node)
    req = PlanRequest(cfg=cfg, device=H100, itemsize=2, weight_itemsize=None, kv_itemsize=None, fp8_matmuls=False,
                      gpus_per_node=8, num_nodes=2, max_model_len=4096, context_len=1024, concurrency=1,
                      gpu_memory_utilization=0.9)
    assert layout_sizes(req, 2) == [(1, 1), (2, 1), (4, 1), (4, 2), (4, 3), (4, 4)]


def test_shards_add_up_to_the_model(tmp_path) -> None:
    cfg = HFModelConfig.from_dir(write_config(tmp_path, "Qwen2-72B"))
    whole = ModelCost.from_hf_config(cfg, 2)
    ranks = [ModelCost.shard(cfg, 2, tp_size=4, pp_rank=r, pp_size=2) for r in range(2)]
    # 4 ranks per stage hold every weight once, but the norms and the vocab (152064 = 4 x 38016) are whole
    norms = 80 * 2 * 8192 + 8192
    assert 4 * sum(r.num_params for r in ranks) - 3 * norms == whole.num_params
    # The LM head (152064 x 8192) weighs 1.42 layers: the last stage takes one layer fewer.
    assert [r.num_layers for r in ranks] == [41, 39]
    assert 4 * sum(r.kv_bytes_per_token for r in ranks) == whole.kv_bytes_per_token


def test_bad_requests_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="concurrency: must be at least 1"):
        request(tmp_path, "Llama-3-8B", concurrency=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization: must be in"):
        request(tmp_path, "Llama-3-8B", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="longer than max_model_len"):
        request(tmp_path, "Llama-3-8B", max_model_len=512)
