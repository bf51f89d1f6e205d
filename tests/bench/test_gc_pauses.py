"""The collector's pauses a benchmark run reports."""

from __future__ import annotations

import gc

from tandem.bench.gc_pauses import GcPauses


def test_counts_each_collection_and_its_generation_while_entered() -> None:
    gc.disable()  # no automatic collection may add to the counts
    try:
        with GcPauses() as pauses:
            gc.collect(0)
            gc.collect(1)
            gc.collect()
        gc.collect()  # after exit: not observed
    finally:
        gc.enable()
    assert (pauses.collections, pauses.oldest_collections) == (3, 1)
    assert 0 < pauses.longest_s <= pauses.total_s
    assert pauses._observe not in gc.callbacks
