"""Loading a local Hugging Face directory: what is refused, and what is read."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem.workers.llm import LLM
from tandem.workers.model.hf_config import HFModelConfig
from tandem.workers.model.loader import checkpoint_files


def _copy(model_dir: str, tmp_path) -> str:
    dst = tmp_path / "model"
    shutil.copytree(model_dir, dst)
    return str(dst)


def test_unknown_architecture_is_refused_naming_the_supported_ones(llama_dir: str, tmp_path) -> None:
    path = _copy(llama_dir, tmp_path)
    cfg_path = f"{path}/config.json"
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=r"^model: architecture .*GPT2LMHeadModel.*LlamaForCausalLM, "
                                         r"MistralForCausalLM, Qwen2ForCausalLM"):
        LLM(path)


def test_missing_directory_and_missing_weights_are_clear(llama_dir: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="^model: no config.json"):
        LLM(str(tmp_path / "nowhere"))
    path = _copy(llama_dir, tmp_path)
    (tmp_path / "model" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="^model: no model.safetensors"):
        LLM(path)


def test_config_reads_both_rope_forms_and_generation_eos() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    old = HFModelConfig.from_dict({**base, "rope_theta": 500000.0,
                                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, (7, 8))
    new = HFModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                               "rope_theta": 500000.0}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert old.eos_token_ids == (7, 8) and old.num_key_value_heads == 2 and old.head_dim == 4


def test_sharded_index_maps_every_tensor_to_its_file() -> None:
    from tests.conftest import tiny_model

    files = checkpoint_files(tiny_model("llama", max_shard_size="40KB"))
    assert len(set(files.values())) > 1
    assert "model.layers.1.mlp.down_proj.weight" in files


def test_a_missing_tokenizer_is_clear_after_the_model_loads_beside_it(llama_dir: str, tmp_path) -> None:
    # The tokenizer loads on a thread while the weights load; its error still reaches the caller.
    path = _copy(llama_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "model" / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="^model: cannot load a tokenizer from"):
        LLM(path)
