"""HostKVTier: where evicted prefix blocks go instead of away (the engine's index of it).

The block contents live on the workers (each rank its shard, in host memory: pinned on
CUDA); this class only decides which host slot holds which block hash, in LRU order,
and queues the copies the workers make at the start of the next step:

    saves: (device block -> host slot)   a cached block the pool is about to reuse
    loads: (host slot -> device block)   a prefix hit found only in host memory

Workers apply saves before loads, both before the step's forward, so a block that is
evicted and refilled in one step is read out before it is overwritten. A slot that a
load in the pending step reads from is pinned until the step's copies are drained, so
no save can overwrite it first.
"""

from __future__ import annotations

from collections import OrderedDict


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"host KV tier: needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.saves: list[tuple[int, int]] = []
        self.loads: list[tuple[int, int]] = []
        self.num_saved = 0
        self.num_loaded = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def num_pinned(self) -> int:
        """Slots held for a pending step's loads: none once the engine is idle."""
        return len(self._pinned)

    def lookup(self, block_hash: int) -> int | None:
        return self._slot_of.get(block_hash)

    def hashes(self) -> list[int]:
        return list(self._slot_of)

    def save(self, block_id: int, block_hash: int) -> tuple[bool, int | None]:
        """Keep an evicted device block. Returns (kept, the hash this pushed out of host memory)."""
        if block_hash in self._slot_of:  # already here (it was loaded from here): same bytes
            self._slot_of.move_to_end(block_hash)
            return True, None
        dropped = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:  # every slot is being read this step: let this block go
                return False, None
            slot = self._slot_of.pop(victim)
            dropped = victim
        self._slot_of[block_hash] = slot
        self.saves.append((block_id, slot))
        self.num_saved += 1
        return True, dropped

    def pin(self, slots: list[int]) -> None:
        self._pinned.update(slots)

    def unpin(self, slots: list[int]) -> None:
        self._pinned.difference_update(slots)

    def load(self, slot: int, block_id: int, block_hash: int) -> None:
        """Queue a copy back to the device (the host copy stays, most recently used)."""
        self._slot_of.move_to_end(block_hash)
        self.loads.append((slot, block_id))
        self.num_loaded += 1

    def reserve(self, block_hash: int) -> tuple[int | None, int | None]:
        """A slot for a block arriving from elsewhere (another group): (slot or None if it is
        here already or every slot is pinned, the hash this pushed out)."""
        if block_hash in self._slot_of:
            return None, None
        kept, dropped = self.save(-1, block_hash)
        if not kept:
            return None, None
        _, slot = self.saves.pop()  # not a device copy: the caller writes the slot itself
        self.num_saved -= 1
        return slot, dropped

    def discard(self, block_hashes: list[int]) -> None:
        """Forget reserved blocks whose data never arrived (an import refused): their slots are free."""
        for block_hash in block_hashes:
            slot = self._slot_of.pop(block_hash, None)
            if slot is not None:
                self._free.append(slot)

    def drain(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The pending step's copies; their slots stop being pinned."""
        saves, loads = self.saves, self.loads
        self.saves, self.loads = [], []
        self._pinned.clear()
        return saves, loads

    def clear(self) -> list[int]:
        """Forget everything (prefix cache reset); returns the hashes dropped."""
        dropped = list(self._slot_of)
        self._slot_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self.saves, self.loads = [], []
        return dropped
