from __future__ import annotations

import random

import pytest

from tandem.cluster.prefix_directory import PrefixDirectory
from tandem.workers.core.block_pool import hash_block


def _chain(tokens: list[int], block_size: int = 4) -> list[int]:
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start:start + block_size]))
    return hashes


def test_match_counts_leading_blocks_per_group() -> None:
    d = PrefixDirectory()
    chain = _chain(list(range(24)))  # 6 blocks
    d.apply("a", [("stored", h) for h in chain[:4]])
    d.apply("b", [("stored", h) for h in chain[:2]] + [("stored", chain[3])])  # a hole at block 2
    assert d.match(chain) == {"a": 4, "b": 2}
    assert d.match(_chain(list(range(100, 124)))) == {}


def test_removed_blocks_and_dead_groups_drop_out() -> None:
    d = PrefixDirectory()
    chain = _chain(list(range(16)))
    for g in ("a", "b"):
        d.apply(g, [("stored", h) for h in chain])
    d.apply("a", [("removed", chain[1])])
    assert d.match(chain) == {"a": 1, "b": 4}
    d.remove_group("b")
    assert d.match(chain) == {"a": 1}
    assert d.num_blocks("a") == 3 and d.num_blocks("b") == 0
    with pytest.raises(ValueError, match="kind"):
        d.apply("a", [("moved", 1)])


def test_interleaved_stores_and_evictions_from_many_groups_match_a_replay() -> None:
    """Concurrent publishers: the directory equals the per-group sets implied by the events."""
    rng = random.Random(0)
    chains = [_chain([rng.randrange(1000) for _ in range(32)]) for _ in range(5)]
    d = PrefixDirectory()
    truth: dict[str, set[int]] = {g: set() for g in "abc"}
    for _ in range(2000):
        g = rng.choice("abc")
        chain = rng.choice(chains)
        h = chain[rng.randrange(len(chain))]
        kind = rng.choice(("stored", "removed"))
        d.apply(g, [(kind, h)])
        (truth[g].add if kind == "stored" else truth[g].discard)(h)
    for chain in chains:
        expected = {}
        for g, held in truth.items():
            n = 0
            while n < len(chain) and chain[n] in held:
                n += 1
            if n:
                expected[g] = n
        assert d.match(chain) == expected
