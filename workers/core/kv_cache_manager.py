"""Per-request KV block bookkeeping on top of a BlockPool.

A request's block table covers every token whose KV is (or is about to be)
written: `ceil((num_computed + num_new + lookahead) / block_size)` blocks. Full
blocks are published to the prefix cache only once their KV is computed (for
speculative tokens: once verified), so a cache hit never returns unwritten KV.

With a host tier (`enable_host_tier`), a cached block evicted for reuse is saved to
host memory first, and a prompt's chain continues there past its last device hit:
such blocks are allocated on the device at admission and filled by a copy at the
start of the step (see host_tier.py), so they count as computed, like device hits.
"""

from __future__ import annotations

from collections.abc import Iterator

from tandem.workers.core.block_pool import BlockPool, hash_block
from tandem.workers.core.host_tier import HostKVTier
from tandem.workers.core.request import Request, token_slice


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host: HostKVTier | None = None

    def enable_host_tier(self, num_slots: int) -> None:
        self.host = HostKVTier(num_slots)
        self.pool.on_evict = self._save_to_host

    def _save_to_host(self, block_id: int, block_hash: int) -> bool:
        kept, dropped = self.host.save(block_id, block_hash)
        if dropped is not None and self.pool.lookup(dropped) is None:
            self.pool.record_removed(dropped)
        return kept

    def drain_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return self.host.drain() if self.host is not None else ([], [])

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend the request's hash chain over its full blocks within num_tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        while (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            tokens = token_slice(req.prompt_token_ids, req.output_token_ids, start, start + bs)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))

    def _chain(self, req: Request, start: int, stop: int) -> Iterator[int]:
        """The request's block hashes from block `start` up to `stop`, each hashed only when the
        caller asks for it: a lookup stops at its first miss, and blocks past it are hashed
        when their KV is computed (`cache_blocks`), while the device runs a step, rather than
        all at admission, before the first step's launch."""
        for i in range(start, stop):
            if i == len(req.block_hashes):
                self._update_hashes(req, (i + 1) * self.block_size)
            yield req.block_hashes[i]

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Leading blocks of the request found in the prefix cache (not yet referenced).

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hits: list[int] = []
        for block_hash in self._chain(req, 0, (req.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def get_host_hits(self, req: Request, num_device_hits: int) -> list[int]:
        """Host slots holding the blocks that follow the request's device hits."""
        if self.host is None or req.sampling_params.prompt_logprobs is not None:
            return []
        slots: list[int] = []
        for block_hash in self._chain(req, num_device_hits, (req.num_tokens - 1) // self.block_size):
            slot = self.host.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Blocks a running request lacks for `num_new_tokens` more slots (<= 0: none)."""
        return _cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_ids)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None,
                       num_lookahead: int = 0, host_slots: list[int] | None = None) -> list[int] | None:
        """Reserve slots for num_new_tokens (+ lookahead); None if the pool is short.

        computed_blocks (device prefix hits at admission) are referenced here, and the
        blocks host_slots (host hits right after them) are copied into allocated, atomically
        with the allocation, so a failed allocation leaves no trace.
        """
        if not computed_blocks and not host_slots:  # a running request's next tokens: the common case
            num_new_blocks = self.num_new_blocks(req, num_new_tokens + num_lookahead)
            if num_new_blocks <= 0:
                return []
            if num_new_blocks > self.pool.num_free_blocks:
                return None
            new_blocks = self.pool.allocate(num_new_blocks)
            req.block_ids.extend(new_blocks)
            return new_blocks
        computed_blocks = computed_blocks or []
        host_slots = host_slots or []
        num_hits = len(computed_blocks) + len(host_slots)
        num_computed = req.num_computed_tokens + num_hits * self.block_size
        num_needed = _cdiv(num_computed + num_new_tokens + num_lookahead, self.block_size)
        num_new_blocks = max(0, num_needed - len(req.block_ids) - len(computed_blocks))
        # Hits sitting in the free queue stop being free once referenced.
        num_evictable_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            req.block_ids.extend(computed_blocks)
        if host_slots:
            self.host.pin(host_slots)  # the evictions below must not save over them
        new_blocks = self.pool.allocate(num_new_blocks)
        req.block_ids.extend(new_blocks)
        for i, (slot, block_id) in enumerate(zip(host_slots, new_blocks)):
            index = len(computed_blocks) + i
            block_hash = req.block_hashes[index]
            self.host.load(slot, block_id, block_hash)
            # Valid from the start of this step (loads run before the forward): publish now.
            self.pool.cache(block_id, block_hash, req.block_hashes[index - 1] if index else None)
        if num_hits:
            # Hits are already published; don't publish them again.
            req.num_published_blocks = num_hits
        return new_blocks

    def cache_blocks(self, req: Request) -> None:
        """Publish the request's newly full and computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # A pending token (scheduled ahead, value unknown) cannot be hashed yet.
        num_known = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_pending
        num_full = min(req.num_computed_tokens, num_known) // self.block_size
        done = req.num_published_blocks
        if num_full <= done:
            return
        self._update_hashes(req, num_full * self.block_size)
        for i in range(done, num_full):
            parent = req.block_hashes[i - 1] if i > 0 else None
            self.pool.cache(req.block_ids[i], req.block_hashes[i], parent)
        req.num_published_blocks = num_full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free tail blocks beyond what num_tokens need (after rejected speculative tokens)."""
        keep = _cdiv(num_tokens, self.block_size)
        if len(req.block_ids) > keep:
            tail = req.block_ids[keep:]
            del req.block_ids[keep:]
            self.pool.free(tail[::-1])

    def reset_host_tier(self) -> None:
        if self.host is not None:
            for block_hash in self.host.clear():
                if self.pool.lookup(block_hash) is None:
                    self.pool.record_removed(block_hash)

    def free(self, req: Request) -> None:
        # Tail first: when these become evictable, the prefix head goes last.
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_published_blocks = 0
