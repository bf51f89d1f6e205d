"""Random-weight Llamas of real models' shapes, so that a GPU benchmark needs no download.

`bench_model_dir(shape)` writes one once into tandem's model cache (beside the CPU benchmark
model of `demo_model.bench_model_path()`, under a name that hashes the shape) and returns its
path every time after. The checkpoint is an ordinary HF directory: config, bfloat16
safetensors shards with their index, and demo_model's byte-level BPE tokenizer.

Each tensor is drawn from its own seeded generator and the shards are written one at a time,
so at most one shard is ever in memory (Llama-3-8B's shape is 14.5 GB) and a shape always
gives the same bytes. Linear and embedding weights are N(0, 0.02), as the HF initialiser
draws them, which keeps a random model's activations at a sane scale through 32 layers; the
RMSNorm weights are ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1  # part of the cache key: a change to what is written means a new directory
MAX_SHARD_BYTES = 2 << 30
BYTES_PER_PARAM = 2  # bfloat16


@dataclass(frozen=True)
class BenchShape:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 32000
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    seed: int = 0

    @property
    def cache_name(self) -> str:
        digest = hashlib.sha256(repr((FORMAT_VERSION, dataclasses.astuple(self))).encode()).hexdigest()[:12]
        return f"bench-{self.name}-{digest}"


LLAMA_1B = BenchShape("llama-1b", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True)
LLAMA_8B = BenchShape("llama-8b", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=14336)
BENCH_SHAPES: dict[str, BenchShape] = {shape.name: shape for shape in (LLAMA_1B, LLAMA_8B)}


def bench_model_dir(shape: BenchShape, show_progress: bool = True) -> str:
    """The checkpoint of `shape`, written on first use."""
    from tandem.workers.model.demo_model import cached_dir

    size_gb = checkpoint_bytes(shape) / 1e9
    return cached_dir(shape.cache_name, lambda tmp: write_checkpoint(tmp, shape, show_progress=show_progress),
                      what=f"{size_gb:.2f} GB of weights")


def tensor_shapes(shape: BenchShape) -> list[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, shape) of every weight, in the order they are drawn and written."""
    hidden, inter, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_out, kv_out = shape.num_attention_heads * head_dim, shape.num_key_value_heads * head_dim
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab_size, hidden))]
    for i in range(shape.num_hidden_layers):
        layer = f"model.layers.{i}"
        tensors += [
            (f"{layer}.input_layernorm.weight", (hidden,)),
            (f"{layer}.self_attn.q_proj.weight", (q_out, hidden)),
            (f"{layer}.self_attn.k_proj.weight", (kv_out, hidden)),
            (f"{layer}.self_attn.v_proj.weight", (kv_out, hidden)),
            (f"{layer}.self_attn.o_proj.weight", (hidden, q_out)),
            (f"{layer}.post_attention_layernorm.weight", (hidden,)),
            (f"{layer}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{layer}.mlp.up_proj.weight", (inter, hidden)),
            (f"{layer}.mlp.down_proj.weight", (hidden, inter)),
        ]
    tensors.append(("model.norm.weight", (hidden,)))
    if not shape.tie_word_embeddings:
        tensors.append(("lm_head.weight", (shape.vocab_size, hidden)))
    return tensors


def checkpoint_bytes(shape: BenchShape) -> int:
    return sum(math.prod(dims) for _, dims in tensor_shapes(shape)) * BYTES_PER_PARAM


def random_tensor(shape: BenchShape, index: int, name: str, dims: tuple[int, ...]) -> torch.Tensor:
    """Tensor `index` of `tensor_shapes(shape)`: ones for a norm, else N(0, init_std) from its own seed."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(shape.seed * 1_000_003 + index)
    return torch.empty(dims, dtype=torch.bfloat16).normal_(0.0, shape.init_std, generator=generator)


def shard_plan(shape: BenchShape, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[int]]:
    """Indices into `tensor_shapes(shape)` per shard, in order; a shard closes before it would pass the bound."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, dims) in enumerate(tensor_shapes(shape)):
        num_bytes = math.prod(dims) * BYTES_PER_PARAM
        if shards[-1] and size + num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += num_bytes
    return shards


def write_checkpoint(path: str | os.PathLike[str], shape: BenchShape, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                     show_progress: bool = True) -> str:
    """Write `shape`'s checkpoint (config, tokenizer, bfloat16 shards and their index) into `path`."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from tandem.workers.model.demo_model import build_tokenizer, generation_config, model_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size, shape.seed)
    assert len(tokenizer) == shape.vocab_size, f"the tokenizer came out with {len(tokenizer)} entries"
    config = model_config(
        tokenizer, architecture="llama", hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings, init_std=shape.init_std, dtype="bfloat16")
    config.save_pretrained(path)
    generation_config(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)

    tensors = tensor_shapes(shape)
    plan = shard_plan(shape, max_shard_bytes)
    total_bytes = checkpoint_bytes(shape)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total_bytes, desc=f"writing {shape.name}", unit="B", unit_scale=True, disable=not show_progress)
    for number, indices in enumerate(plan, start=1):
        filename = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        shard = {}
        for i in indices:
            name, dims = tensors[i]
            shard[name] = random_tensor(shape, i, name, dims)
            weight_map[name] = filename
            bar.update(math.prod(dims) * BYTES_PER_PARAM)
        save_file(shard, str(path / filename), metadata={"format": "pt"})
        del shard
    bar.close()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return str(path)

