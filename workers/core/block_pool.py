"""One replica group's KV blocks: free queue, reference counts, prefix cache.

A block is either in use (ref_cnt > 0) or free. A free block may still hold a
cached prefix (it has a hash): it stays findable until the allocator needs the
block for something else, and the least recently freed cached block goes first
(LRU). Blocks of a finished request are freed tail first, so a prefix's head
outlives its tail.

    free queue (LRU order):  [oldest free ... newest free]
    cached:                  hash -> block_id  (subset of all blocks, in use or free)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class LocalCapacity:
    """The blocks of the KV tensors this process (or group) allocated: a pool draws its
    blocks from it, and gives them back on close."""

    total_blocks: int
    granted: int = 0

    def acquire(self, num_blocks: int) -> int:
        num = min(num_blocks, self.total_blocks - self.granted)
        self.granted += num
        return num

    def release(self, num_blocks: int) -> None:
        assert 0 <= num_blocks <= self.granted
        self.granted -= num_blocks


def hash_block(parent_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """Hash of a full block chained to its parent, so it covers the whole prefix.

    blake2b rather than Python's hash(): stable across processes and machines,
    which the cluster-wide prefix directory relies on.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent_hash is None else parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hash chain of a prompt's full blocks that a prefix cache can serve.

    Stops one token short of the end, as `KVCacheManager.get_computed_blocks` does:
    the last prompt token is always computed (its logits give the first output).
    """
    hashes: list[int] = []
    for i in range((len(token_ids) - 1) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass(frozen=True)
class BlockEvent:
    """A change to the prefix cache, published (in batches) to the cluster directory."""

    kind: str  # "stored" | "removed"
    block_hash: int
    parent_hash: int | None = None


class BlockPool:
    def __init__(self, source: LocalCapacity, num_blocks: int, *, record_events: bool = False) -> None:
        self.num_blocks = source.acquire(num_blocks)
        assert self.num_blocks > 0, "the capacity granted no KV blocks"
        self._source = source
        self.ref_cnt = [0] * self.num_blocks
        self.block_hash: list[int | None] = [None] * self.num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[int, int] = {}
        self.record_events = record_events
        self.events: list[BlockEvent] = []
        # Called with (block_id, hash) as a cached block is evicted for reuse; True = its
        # contents were kept elsewhere (the host tier), so the group still holds the prefix.
        self.on_evict: Callable[[int, int], bool] | None = None

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Take num free blocks (evicting cached ones, LRU first). Caller checked the count."""
        assert num <= len(self._free), f"asked for {num} blocks, {len(self._free)} free"
        ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by prefix lookup."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; pass tail first so heads are evicted last."""
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: int, parent_hash: int | None) -> None:
        """Record a full, computed block under its chained hash."""
        if self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # the same prefix was computed twice (e.g. in one step); keep the first
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.record_events:
            self.events.append(BlockEvent("stored", block_hash, parent_hash))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no request holds. Walks the cached blocks, not the free
        queue: a GPU's pool has ~10^5 blocks, and benchmarks reset before every run."""
        for block_id in [b for b in self._cached.values() if self.ref_cnt[b] == 0]:
            self._evict(block_id, keep=False)

    def drain_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self._source.release(self.num_blocks)

    def record_stored(self, block_hash: int, parent_hash: int | None) -> None:
        """The group now holds this block elsewhere (its host tier, from another group)."""
        if self.record_events:
            self.events.append(BlockEvent("stored", block_hash, parent_hash))

    def record_removed(self, block_hash: int) -> None:
        """The group no longer holds this prefix block anywhere (also for the host tier)."""
        if self.record_events:
            self.events.append(BlockEvent("removed", block_hash))

    def _evict(self, block_id: int, keep: bool = True) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is None:
            return
        self.block_hash[block_id] = None
        del self._cached[block_hash]
        if not (keep and self.on_evict is not None and self.on_evict(block_id, block_hash)):
            self.record_removed(block_hash)

    def check_all_free(self) -> None:
        """The accounting invariant once no request holds blocks."""
        assert len(self._free) == self.num_blocks, (
            f"{self.num_blocks - len(self._free)} of {self.num_blocks} blocks still in use")
        assert max(self.ref_cnt) == 0, "a block has a reference count above zero"
