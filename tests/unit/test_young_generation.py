"""A serving process collects its young generation every 10,000 net allocations (or what
TANDEM_GC_YOUNG_THRESHOLD says), its older generations as CPython does."""

from __future__ import annotations

import gc

import pytest

from tandem.workers.young_generation import YOUNG_THRESHOLD, widen_young_generation


@pytest.fixture(autouse=True)
def _restored_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_the_young_generation_is_widened_and_the_older_ones_kept(monkeypatch):
    monkeypatch.delenv("TANDEM_GC_YOUNG_THRESHOLD", raising=False)
    assert widen_young_generation() == YOUNG_THRESHOLD == 10_000
    assert gc.get_threshold() == (10_000, 10, 10)


def test_the_environment_sets_it_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_GC_YOUNG_THRESHOLD", "700")
    assert widen_young_generation() == 700
    assert gc.get_threshold() == (700, 10, 10)
    monkeypatch.setenv("TANDEM_GC_YOUNG_THRESHOLD", "0")
    with pytest.raises(ValueError, match="^TANDEM_GC_YOUNG_THRESHOLD: must be at least 1, not 0$"):
        widen_young_generation()
