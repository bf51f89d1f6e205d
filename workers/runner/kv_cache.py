"""This rank's KV cache: the device blocks in its model's attention layers, the host tier's
slots, and block copies between them and out of the group.

The device cache holds one block more than the pool hands out: the scratch block (id
`num_blocks`), which padding rows of a graph batch read and write, and which no request ever
holds. The host tier (workers/core/host_tier.py decides what goes there) keeps evicted blocks
in host memory, per layer K and V of this rank's shard; blocks are exported and imported in
one layout, [layers, 2, blocks, block_size, heads, head_dim], so another group can take them.

The cache's dtype is the model's, or float8_e4m3fn (`kv_cache_dtype` fp8): then each layer's
K and V scales (`k_scale` / `v_scale` of its attention module) say what the bytes mean, and
the kernels read them through the key cache (workers/kernels/kv_quant.py `bind_scales`).
Blocks, host slots and exports are all in the cache's dtype, so an FP8 cache holds twice the
tokens of a bf16 one in the same bytes; an export carries its dtype and scales, and a cache
takes only blocks of its own dtype and scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.workers.kernels import kv_quant
from tandem.workers.kernels.huge_pages import zeros_huge
from tandem.workers.model.llama import LlamaForCausalLM


@dataclass
class ExportedKV:
    """One rank's KV of some blocks, as another group imports it."""

    data: torch.Tensor  # [layers, 2, blocks, block_size, heads, head_dim], on the CPU, in the cache's dtype
    scales: tuple[tuple[float, float], ...]  # per layer (k_scale, v_scale); 1.0 for a float cache

    def select(self, positions: list[int]) -> ExportedKV:
        """Only the blocks at `positions` (in the exported order)."""
        return ExportedKV(self.data[:, :, positions], self.scales)


class KVCache:
    """The KV cache of `model`'s attention layers (this rank's heads), on its device and in host slots."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        self.host_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bytes_per_block(self) -> int:
        """K and V of one block over this rank's layers, in the cache's dtype (FP8: one byte a value)."""
        attn = self.model.attention_layers[0]
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        return per_layer * len(self.model.layers)

    def allocate(self, num_blocks: int) -> None:
        """num_blocks for the pool, plus the scratch block (id num_blocks) for padding rows."""
        self.num_blocks = num_blocks
        for attn in self.model.attention_layers:
            shape = ((num_blocks + 1) * self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.key_cache, attn.value_cache = (self._zeros(shape) for _ in range(2))
            kv_quant.bind_scales(attn.key_cache, attn)

    def scales(self) -> tuple[tuple[float, float], ...]:
        """Per layer (k_scale, v_scale), as the kernels read them now (1.0 for a float cache)."""
        return tuple(kv_quant.scales_of(attn.key_cache) if attn.key_cache is not None else (1.0, 1.0)
                     for attn in self.model.attention_layers)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":  # decode reads blocks scattered over the cache: huge pages
            return zeros_huge(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- the host KV tier and block transfer ---------------------------------------------------
    def init_host_cache(self, num_slots: int) -> None:
        """Host-memory slots for evicted KV blocks: per layer, K and V of this rank's shard."""
        pin = self.device.type == "cuda"  # pinned pages: the copies run at full PCIe speed
        self.host_cache = [
            tuple(torch.zeros((num_slots, self.block_size, attn.num_kv_heads, attn.head_dim), dtype=self.dtype,
                              pin_memory=pin) for _ in range(2))
            for attn in self.model.attention_layers]

    def _block_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V as [blocks, block_size, heads, head_dim] (the scratch block left out)."""
        views = []
        num_slots = self.num_blocks * self.block_size
        for attn in self.model.attention_layers:
            shape = (self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            views.append((attn.key_cache[:num_slots].view(shape), attn.value_cache[:num_slots].view(shape)))
        return views

    @torch.inference_mode()
    def apply_host_copies(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Saves (device block -> host slot) first, then loads (host slot -> device block)."""
        for pairs, to_host in ((saves, True), (loads, False)):
            if not pairs:
                continue
            src, dst = zip(*pairs)
            for device_kv, host_kv in zip(self._block_views(), self.host_cache):
                for dev, host in zip(device_kv, host_kv):
                    # FP8 goes as uint8: torch has no float8 index_copy_ on CPU.
                    dev, host = kv_quant.storage(dev), kv_quant.storage(host)
                    if to_host:
                        blocks = torch.tensor(src, device=self.device)
                        host.index_copy_(0, torch.tensor(dst), dev.index_select(0, blocks).to("cpu"))
                    else:
                        rows = host.index_select(0, torch.tensor(src)).to(self.device, non_blocking=True)
                        dev.index_copy_(0, torch.tensor(dst, device=self.device), rows)

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> ExportedKV:
        """This rank's KV of some device blocks, on the CPU, with the scales that give them meaning."""
        index = torch.tensor(block_ids, device=self.device)
        data = torch.stack([torch.stack([kv_quant.storage(kv).index_select(0, index) for kv in layer])
                            for layer in self._block_views()]).to("cpu").view(self.dtype)
        return ExportedKV(data, self.scales())

    @torch.inference_mode()
    def import_host_blocks(self, slots: list[int], blocks: ExportedKV) -> None:
        """Write blocks exported by another group (same layout, dtype and scales) into host slots.
        Blocks of another KV dtype or other scales are refused before anything is written."""
        if blocks.data.dtype != self.dtype or tuple(blocks.scales) != self.scales():
            raise ValueError(
                f"KV blocks in {blocks.data.dtype} (scales {_short(blocks.scales)}) cannot go into this "
                f"group's {self.dtype} cache (scales {_short(self.scales())}): groups whose KV cache dtypes "
                "or scales differ never exchange blocks")
        index = torch.tensor(slots)
        for layer, host_kv in zip(blocks.data, self.host_cache):
            for part, host in zip(layer, host_kv):
                kv_quant.storage(host).index_copy_(0, index, kv_quant.storage(part))


def _short(scales: tuple[tuple[float, float], ...]) -> str:
    """Scales for an error message: one pair when every layer has it."""
    return str(scales[0]) if len(set(scales)) == 1 else str(scales)
