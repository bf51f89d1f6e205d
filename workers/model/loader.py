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
        self._handle, self._name = handle, name
        self._slice = handle.get_slice(name)
        self.dtype = dtype
        stored = self._slice.get_dtype()
        if _STORED_8BIT.get(dtype, stored) != stored:  # casting would drop the scales
            raise ValueError(f"model: {name} is {stored} in the checkpoint, and its layer is quantized to {dtype} "
                             "(a checkpoint's quantization_config must describe its tensors)")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            if not self.shape:  # a 0-d scale: no slice to take
                return self._handle.get_tensor(self._name).to(self.dtype)
            index = slice(None)  # safetensors slices take slices, not `...`
        return self._slice[index].to(self.dtype)


# A quantized parameter's dtype -> how safetensors names it: read as stored, never cast.
_STORED_8BIT = {torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}


class _PackedInt8:
    """compressed-tensors' pack-quantized 8-bit weight: [out, in / 4] int32, four values a word
    (value j of a row in word j // 4 at bits 8 * (j % 4), stored as value + 128), read back as
    int8 [out, in] and indexed like the weight it packs."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        rows, words = self._slice.get_shape()
        self.shape = (rows, words * 4)

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = (index if isinstance(index, tuple) else (index, slice(None)))
        words = self._slice[rows].to(torch.int32)
        shifts = torch.arange(4, dtype=torch.int32) * 8
        values = ((words.unsqueeze(-1) >> shifts) & 0xFF) - 128  # [rows, words, 4]
        return values.reshape(words.shape[0], -1)[:, cols].to(torch.int8)


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
                 show_progress: bool = True, kv_scales: bool = False) -> int:
    """Fill the model's parameters from the checkpoint of a model reference (at `revision` for a
    Hub repo); returns the number of tensors read. Each tensor is read in its parameter's dtype:
    quantized weights as stored, scales in float32, the rest in the model's dtype. With
    `kv_scales` (an FP8 KV cache), the checkpoint's k_scale / v_scale are read where it has them."""
    targets = model.weight_targets()
    model_dir = resolve_model(model_dir, revision)
    files = checkpoint_files(model_dir)
    if kv_scales:
        targets.update({name: target for name, target in model.kv_scale_targets().items() if name in files})
    by_file: dict[str, list[str]] = {}
    for target in targets:
        name = target.removesuffix("@tied")
        if name == "lm_head.weight" and name not in files:
            name = "model.embed_tokens.weight"  # tied head without an explicit tensor
        if name not in files:
            raise ValueError(f"model: checkpoint in {model_dir!r} has no tensor {name!r}")
        by_file.setdefault(files[name], []).append(target)
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not show_progress, leave=False)
    for path, names in sorted(by_file.items()):
        with safe_open(path, framework="pt") as handle:
            for target in names:
                name = target.removesuffix("@tied")
                if name == "lm_head.weight" and name not in files:
                    name = "model.embed_tokens.weight"
                param, loader, part = targets[target]
                if name.endswith(".weight_packed"):
                    source: Any = _PackedInt8(handle, name)
                else:
                    source = _LazyTensor(handle, name, param.dtype if param is not None else torch.float32)
                loader(param, source, part)
                bar.update(1)
    bar.close()
    return len(targets)
