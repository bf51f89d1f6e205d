"""KVFetcher: before admitting a request, bring its prefix from another group when that pays.

A group that misses part of a prompt's prefix asks the cluster prefix directory which
group with the same KV layout holds more of it, asks that group to export the blocks
(a `GroupServer.export_prefix` call, routed to it by `target_group`), and writes them
into its own host tier (workers/engine/kv_transfer.py), where admission finds them.

The estimate that decides (`FetchCost`), both sides in seconds:

    fetch     = overhead_s + num_blocks * block_bytes / bandwidth_bytes_per_s
    recompute = num_blocks * block_size / prefill_tokens_per_s

`prefill_tokens_per_s` is the group's own measured prefill speed (an EMA over its
prefill-heavy steps); until it has one, a fetch of `min_blocks` or more is assumed to
pay. `overhead_s` covers the directory lookup and the two calls; `bandwidth` is the
object store's (same node: GB/s; across nodes: the network's). A fetch that fails or
takes longer than `timeout_s` is dropped and the prefix recomputed: it never fails a
request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.cluster.kv_allocator import AllocatorRef
from tandem.workers.core.block_pool import prompt_block_hashes
from tandem.workers.serving.messages import PrefixExport, PrefixExportRequest

if TYPE_CHECKING:
    from tandem.workers.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

FETCH_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class FetchCost:
    overhead_s: float = 0.01
    bandwidth_bytes_per_s: float = 1e9
    min_blocks: int = 2

    def pays(self, num_blocks: int, block_bytes: int, block_size: int, prefill_tokens_per_s: float | None) -> bool:
        if num_blocks < self.min_blocks:
            return False
        if prefill_tokens_per_s is None:
            return True
        fetch_s = self.overhead_s + num_blocks * block_bytes / self.bandwidth_bytes_per_s
        return fetch_s < num_blocks * block_size / prefill_tokens_per_s


class KVFetcher:
    def __init__(self, engine: AsyncEngine, group_id: str, app_name: str, layout: str, *, mode: str = "auto",
                 cost: FetchCost = FetchCost(), timeout_s: float = 5.0) -> None:
        if mode not in FETCH_MODES:
            raise ValueError(f"kv_fetch: must be one of {', '.join(FETCH_MODES)}, got {mode!r}")
        self.engine = engine
        self.group_id = group_id
        self.app_name = app_name
        self.layout = layout
        self.mode = mode
        self.cost = cost
        self.timeout_s = timeout_s
        self.block_size = engine.block_size
        self.block_bytes = engine.kv_bytes_per_block()
        self._groups: Any = None  # a handle to this application's GroupServer deployment
        self._allocator = AllocatorRef(app_name)
        self.num_fetches = 0
        self.num_blocks_fetched = 0
        self.num_failed = 0

    async def fetch_for(self, prompt_token_ids: list[int]) -> int:
        """Fetch the prompt's prefix blocks held elsewhere, if it pays; returns blocks fetched."""
        if self.mode == "never":
            return 0
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)
        local = self.engine.held_prefix(hashes)
        if len(hashes) - local < self.cost.min_blocks:
            return 0
        try:
            return await asyncio.wait_for(self._fetch(hashes, local), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: recompute instead
            self.num_failed += 1
            logger.warning("prefix fetch failed (%s: %s); recomputing", type(exc).__name__, exc)
            return 0

    async def _fetch(self, hashes: list[int], local: int) -> int:
        holders = await self._allocator.call("holders", hashes, self.layout)
        holders.pop(self.group_id, None)
        if not holders:
            return 0
        source, held = max(holders.items(), key=lambda item: item[1])
        num = held - local
        speed = self.engine.prefill_tokens_per_s
        if num < self.cost.min_blocks or (
                self.mode == "auto" and not self.cost.pays(num, self.block_bytes, self.block_size, speed)):
            return 0
        reply: PrefixExport = await self._group_handle().export_prefix.remote(
            PrefixExportRequest(target_group=source, block_hashes=hashes[local:held]))
        exported = reply.num_blocks
        if not exported:
            return 0  # evicted there since it published
        imported = await self.engine.import_prefix(hashes[local:local + exported], reply.per_rank)
        self.num_fetches += 1
        self.num_blocks_fetched += imported
        return imported

    def _group_handle(self) -> Any:
        if self._groups is None:
            from ray import serve

            self._groups = serve.get_deployment_handle("GroupServer", app_name=self.app_name)
        return self._groups
