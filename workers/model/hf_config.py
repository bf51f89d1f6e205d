"""The parts of a Hugging Face `config.json` a Llama-family decoder needs.

Parsed from the JSON directly (not through transformers' config classes) so that
both the transformers 4 form (`rope_theta`, `rope_scaling`) and the 5 form
(`rope_parameters`) load, and so an unsupported architecture is refused before
anything else is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.workers.model.source import resolve_model

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class HFModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    layer_sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # The checkpoint's `quantization_config` (a pre-quantized checkpoint), as written; what tandem
    # reads of it is workers/quant/scheme.py's.
    quantization_config: dict | None = None

    @staticmethod
    def from_dir(path: str, revision: str | None = None) -> HFModelConfig:
        """From a model reference (workers/model/source.py): a local directory, a Hub repo id at
        `revision`, or an s3:// or gs:// URI, whose configs (not weights) are fetched to this node."""
        path = resolve_model(path, revision, weights=False)
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"model: no config.json in {path!r} (expected a Hugging Face model directory)")
        with open(config_path) as f:
            cfg = json.load(f)
        return HFModelConfig.from_dict(cfg, _generation_eos(path))

    @staticmethod
    def from_dict(cfg: dict, generation_eos: tuple[int, ...] = ()) -> HFModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"model: architecture {archs or cfg.get('model_type')!r} is not supported; "
                             f"tandem serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        eos_ids = generation_eos or tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        return HFModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 checkpoints tie embeddings unless they say otherwise; Llama/Mistral don't.
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch == "Qwen2ForCausalLM"),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            layer_sliding_windows=_sliding_windows(cfg, arch, num_layers),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=cfg.get("bos_token_id"),
            quantization_config=cfg.get("quantization_config"),
        )

    def resolve_dtype(self, option: str, device: torch.device) -> torch.dtype:
        # torch is imported here: an ingress reads this config and never loads torch.
        import torch

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if option == "auto":
            if device.type == "cpu":
                return torch.float32
            return dtypes.get(self.torch_dtype, torch.bfloat16)
        if option == "float16" and device.type == "cpu":
            raise ValueError("dtype: float16 is not supported on CPU (use float32 or bfloat16)")
        return dtypes[option]


def _sliding_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        if not cfg.get("use_sliding_window", False) or window is None:
            return (None,) * num_layers
        types = cfg.get("layer_types") or ["sliding_attention"] * num_layers
        return tuple(window if t == "sliding_attention" else None for t in types)
    if arch == "MistralForCausalLM" and window is not None:
        return (int(window),) * num_layers
    return (None,) * num_layers


def _generation_eos(path: str) -> tuple[int, ...]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return ()
    with open(gen_path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
