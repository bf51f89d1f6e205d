"""Load this shard's weights from a safetensors checkpoint, fetched to this node first when the
model is remote (workers/model/source.py).

Only the tensors this stage needs are opened, and of those only this TP rank's
rows/columns are read: safetensors slices (`get_slice(name)[a:b]`) read just
the requested bytes from the memory-mapped file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tandem.workers.model.llama import LlamaForCausalLM
from tandem.workers.model.source import resolve_model


class _LazyTensor:
    """A checkpoint tensor that reads only the slice it is indexed with, in a given dtype."""

    def __init__(self, handle: Any, name: str, dtype: torch.dtype) -> None:
        self._slice = handle.get_slice(name)
        self.dtype = dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index].to(self.dtype)


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file, for single-file and sharded (indexed) checkpoints."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"model: no model.safetensors or model.safetensors.index.json in {model_dir!r}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_weights(model: LlamaForCausalLM, model_dir: str, *, revision: str | None = None,
                 show_progress: bool = True) -> int:
    """Fill the model's parameters from the checkpoint of a model reference (at `revision` for a
    Hub repo); returns the number of tensors read."""
    targets = model.weight_targets()
    model_dir = resolve_model(model_dir, revision)
    files = checkpoint_files(model_dir)
    by_file: dict[str, list[str]] = {}
    for target in targets:
        name = target.removesuffix("@tied")
        if name == "lm_head.weight" and name not in files:
            name = "model.embed_tokens.weight"  # tied head without an explicit tensor
        if name not in files:
            raise ValueError(f"model: checkpoint in {model_dir!r} has no tensor {name!r}")
        by_file.setdefault(files[name], []).append(target)
    dtype = next(model.parameters()).dtype
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not show_progress, leave=False)
    for path, names in sorted(by_file.items()):
        with safe_open(path, framework="pt") as handle:
            for target in names:
                name = target.removesuffix("@tied")
                if name == "lm_head.weight" and name not in files:
                    name = "model.embed_tokens.weight"
                param, loader, part = targets[target]
                loader(param, _LazyTensor(handle, name, dtype), part)
                bar.update(1)
    bar.close()
    return len(targets)
