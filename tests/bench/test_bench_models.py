"""The --bench-model checkpoints: their shapes' sizes, the shard plan, and a tiny one written and loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tandem.bench import bench_models
from tandem.bench.bench_models import (
    LLAMA_1B,
    LLAMA_8B,
    BenchShape,
    bench_model_dir,
    checkpoint_bytes,
    random_tensor,
    shard_plan,
    tensor_shapes,
    write_checkpoint,
)
from tests.bench.conftest import TINY_SHAPE


def test_real_shapes_have_their_models_sizes() -> None:
    # Llama-3.2-1B with a 32000 vocabulary (tied), Llama-3-8B likewise (untied): parameters x 2 bytes.
    assert checkpoint_bytes(LLAMA_1B) == 2 * 1_038_682_112
    assert checkpoint_bytes(LLAMA_8B) == 2 * 7_241_732_096
    names = [name for name, _ in tensor_shapes(LLAMA_8B)]
    assert len(names) == 1 + 32 * 9 + 2 and names[-1] == "lm_head.weight"
    assert "lm_head.weight" not in dict(tensor_shapes(LLAMA_1B))
    assert dict(tensor_shapes(LLAMA_1B))["model.layers.0.self_attn.k_proj.weight"] == (8 * 64, 2048)
    assert dict(tensor_shapes(LLAMA_8B))["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    # 14.5 GB in shards of at most 2 GiB: never the whole model in memory.
    assert [len(shard) for shard in shard_plan(LLAMA_8B)] == [43, 42, 43, 43, 44, 44, 32]
    assert LLAMA_1B.cache_name != LLAMA_8B.cache_name


def test_shard_plan_closes_a_shard_before_it_passes_the_bound() -> None:
    # Bytes in order: embed 65536; per layer norm 128, q 8192, k 4096, v 4096, o 8192, norm 128,
    # gate, up, down 16384 each; final norm 128. Bound 72 KiB = 73728.
    assert shard_plan(TINY_SHAPE, max_shard_bytes=72 << 10) == [
        [0, 1],  # + q would make 73856
        [2, 3, 4, 5, 6, 7, 8],  # + down would make 73856
        [9, 10, 11, 12, 13, 14, 15, 16],  # + up would make 73984
        [17, 18, 19]]
    assert shard_plan(TINY_SHAPE, max_shard_bytes=1) == [[i] for i in range(20)]  # a tensor alone may pass it


def test_tiny_checkpoint_loads_in_transformers_with_the_drawn_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(tmp_path / "m", TINY_SHAPE, max_shard_bytes=40 << 10, show_progress=False)
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(shard_plan(TINY_SHAPE, 40 << 10)) > 1
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype="auto")
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    cfg = model.config
    assert model.dtype == torch.bfloat16 and cfg.tie_word_embeddings is True
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 2, 4, 2, 16, 128, 512)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    for i, (name, dims) in enumerate(tensor_shapes(TINY_SHAPE)):
        with safe_open(str(Path(path) / index["weight_map"][name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), random_tensor(TINY_SHAPE, i, name, dims)), name
    assert torch.equal(model.model.layers[1].post_attention_layernorm.weight, torch.ones(64, dtype=torch.bfloat16))
    std = float(model.model.layers[0].mlp.up_proj.weight.detach().float().std())
    assert std == pytest.approx(0.02, rel=0.05)


def test_bench_model_dir_writes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = bench_model_dir(TINY_SHAPE, show_progress=False)
    assert path == str(tmp_path / TINY_SHAPE.cache_name)

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("written twice")

    monkeypatch.setattr(bench_models, "write_checkpoint", fail)
    assert bench_model_dir(TINY_SHAPE) == path
    other = BenchShape(**{**TINY_SHAPE.__dict__, "seed": 1})
    assert other.cache_name != TINY_SHAPE.cache_name  # the key is the whole shape
