"""PrefixLookup: how many leading prompt tokens each replica group holds, for the router.

Two sources, merged by taking the larger count per group:

- the cluster allocator's prefix directory (`KVAllocatorState.match`): what the groups
  have published (their stored / removed block events, batched every ~0.1 s);
- what this router itself sent where in the last `recent_ttl_s` seconds: when a prefix's
  second request arrives, its first may still be prefilling, its blocks not stored, let
  alone published. Without this a burst of one new prefix would scatter.

The second only covers the directory's lag. When the directory cannot be reached (the
allocator is restarting, or slow) the lookup answers nothing and routing is load-only;
requests never wait on the allocator longer than `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable

from tandem.cluster.prefix_directory import leading_blocks
from tandem.workers.core.block_pool import prompt_block_hashes

logger = logging.getLogger(__name__)

Match = Callable[[list[int]], Awaitable[dict[str, int]]]


class RecentRoutes:
    """block hash -> {group: when this router last sent a prompt with that block there}."""

    def __init__(self, ttl_s: float = 10.0, capacity: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        self._sent: OrderedDict[int, dict[Hashable, float]] = OrderedDict()

    def record(self, block_hashes: list[int], group: Hashable) -> None:
        now = self._clock()
        for block_hash in block_hashes:
            self._sent.setdefault(block_hash, {})[group] = now
            self._sent.move_to_end(block_hash)
        while len(self._sent) > self.capacity:
            self._sent.popitem(last=False)

    def match(self, block_hashes: list[int]) -> dict[Hashable, int]:
        """Leading blocks of the chain sent to each group within the TTL."""
        horizon = self._clock() - self.ttl_s
        return leading_blocks(block_hashes,
                              lambda h: (g for g, t in self._sent.get(h, {}).items() if t >= horizon))

    def forget_group(self, group: Hashable) -> None:
        for groups in self._sent.values():
            groups.pop(group, None)


class PrefixLookup:
    def __init__(self, block_size: int, match_directory: Match, *, timeout_s: float = 0.2,
                 recent: RecentRoutes | None = None) -> None:
        self.block_size = block_size
        self._match_directory = match_directory
        self.timeout_s = timeout_s
        self.recent = recent or RecentRoutes()
        self.directory_ok = False  # did the last directory query answer?

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        return prompt_block_hashes(token_ids, self.block_size)

    async def cached_tokens(self, block_hashes: list[int]) -> dict[Hashable, int]:
        """Prompt tokens each group holds (or will, having just been sent the prefix)."""
        if not block_hashes:
            return {}
        try:
            held = await asyncio.wait_for(self._match_directory(block_hashes), self.timeout_s)
            self.directory_ok = True
        except Exception as exc:  # noqa: BLE001 - unreachable, restarting or slow: load only
            if self.directory_ok:
                logger.warning("prefix directory unavailable (%s); routing by load only",
                               type(exc).__name__)
            self.directory_ok = False
            return {}
        counts: dict[Hashable, int] = dict(held)
        for group, n in self.recent.match(block_hashes).items():
            counts[group] = max(counts.get(group, 0), n)
        return {g: n * self.block_size for g, n in counts.items()}


def allocator_matcher(app_name: str, retry_s: float = 1.0) -> Match:
    """A `Match` that asks the application's allocator actor."""
    from tandem.cluster.kv_allocator import AllocatorRef

    allocator = AllocatorRef(app_name, retry_s)

    async def match(block_hashes: list[int]) -> dict[str, int]:
        return await allocator.call("match", block_hashes)

    return match
