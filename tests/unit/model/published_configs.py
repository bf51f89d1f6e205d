"""The config.json of published models (the fields their Hub repos carry), written to a directory.

Llama-3-8B / 70B, Llama-3.1-405B and Llama-3.2-1B are meta-llama's; Mistral-7B is mistralai/Mistral-7B-v0.1;
Qwen2-72B is Qwen/Qwen2-72B-Instruct.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
           "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 8192, "mlp_bias": False, "pretraining_tp": 1,
           "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256}

CONFIGS: dict[str, dict[str, Any]] = {
    "Llama-3-8B": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8},
    "Llama-3-70B": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                    "num_hidden_layers": 80, "num_key_value_heads": 8},
    "Llama-3.1-405B": {**_LLAMA3, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
                       "num_hidden_layers": 126, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                       "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "Llama-3.2-1B": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                     "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "Mistral-7B": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1,
                   "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                   "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                   "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000},
    "Qwen2-72B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
                  "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 8192,
                  "initializer_range": 0.02, "intermediate_size": 29568, "max_position_embeddings": 32768,
                  "max_window_layers": 80, "num_attention_heads": 64, "num_hidden_layers": 80,
                  "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                  "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "use_cache": True, "use_sliding_window": False, "vocab_size": 152064},
}


def write_config(root: Path, name: str, **overrides: Any) -> str:
    """`name`'s config.json (with `overrides`) in its own directory under `root`; that directory."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIGS[name], **overrides}, indent=2))
    return str(path)
