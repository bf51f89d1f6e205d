"""Which replica group holds which cached prefix blocks, cluster-wide.

Groups publish block events (stored, with the block's chained hash; removed) in
batches. Because a block's hash covers its whole prefix, "how many leading blocks
of this sequence does group g hold" is a walk down the request's hash chain that
stops at the first hash g lacks: O(blocks x groups), no token comparison.

The directory may lag the groups by one publish interval; it is advice for
routing, never a promise: a group always re-checks its own cache on admission.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

GroupId = str


def leading_blocks(block_hashes: list[int],
                   holders_of: Callable[[int], Iterable[Hashable]]) -> dict[Hashable, int]:
    """For each holder, how many leading blocks of the chain it holds: a walk that stops
    once no holder has held every block so far."""
    counts: dict[Hashable, int] = {}
    alive: set[Hashable] | None = None
    for i, block_hash in enumerate(block_hashes):
        holders = set(holders_of(block_hash))
        alive = holders if alive is None else alive & holders
        if not alive:
            break
        for holder in alive:
            counts[holder] = i + 1
    return counts


class PrefixDirectory:
    def __init__(self) -> None:
        self._holders: dict[int, set[GroupId]] = {}  # block hash -> groups holding it
        self._held: dict[GroupId, set[int]] = {}  # group -> hashes it holds (for removal)

    def add_group(self, group: GroupId) -> None:
        self._held.setdefault(group, set())

    def apply(self, group: GroupId, events: Iterable[tuple[str, int]]) -> None:
        """Apply ("stored", hash) / ("removed", hash) events from one group, in order."""
        held = self._held.setdefault(group, set())
        for kind, block_hash in events:
            if kind == "stored":
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(group)
            elif kind == "removed":
                held.discard(block_hash)
                holders = self._holders.get(block_hash)
                if holders is not None:
                    holders.discard(group)
                    if not holders:
                        del self._holders[block_hash]
            else:
                raise ValueError(f"block event kind must be 'stored' or 'removed', got {kind!r}")

    def remove_group(self, group: GroupId) -> None:
        """Forget everything a group held (it died, or is re-registering from scratch)."""
        for block_hash in self._held.pop(group, set()):
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(group)
                if not holders:
                    del self._holders[block_hash]

    def match(self, block_hashes: list[int]) -> dict[GroupId, int]:
        """Leading blocks of the chain each group holds (groups with none are omitted)."""
        return leading_blocks(block_hashes, lambda h: self._holders.get(h, ()))

    def num_blocks(self, group: GroupId) -> int:
        return len(self._held.get(group, ()))

    @property
    def groups(self) -> list[GroupId]:
        return list(self._held)
