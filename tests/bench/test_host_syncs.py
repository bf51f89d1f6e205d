"""The sync-debug pass's bookkeeping: torch's warnings counted at the engine's line that raised them.

On CPU torch raises no such warnings; here the run raises torch's message itself, from a line of
this file standing for the engine's code, and the debug mode is switched by a recorder.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

from tandem.bench.host_syncs import SYNC_WARNING, engine_roots, host_sync_figures

HERE = str(Path(__file__).resolve().parent)


def _engine_sync() -> None:
    # What torch raises at a .item() of a device tensor (at the calling line, as stacklevel 1 does).
    warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)


SYNC_LINE = inspect.getsourcelines(_engine_sync)[1] + 2


def _run() -> None:
    for _ in range(3):
        _engine_sync()
    warnings.warn("some other warning", DeprecationWarning, stacklevel=1)


def test_each_sync_is_counted_at_the_engine_line_that_made_it_and_the_mode_is_switched_back() -> None:
    modes: list[int] = []
    with warnings.catch_warnings(record=True) as passed_on:
        warnings.simplefilter("always")
        fig = host_sync_figures(_run, set_mode=modes.append, roots=[HERE])
    assert modes == [1, 0]
    site = f"bench/test_host_syncs.py:{SYNC_LINE} _engine_sync"
    assert fig == {"gpu_host_syncs": 3, "gpu_host_sync_sites": [f"{site}: 3"]}
    # Other warnings reach whoever was listening before.
    assert [str(w.message) for w in passed_on] == ["some other warning"]


def test_syncs_outside_the_engine_are_not_counted() -> None:
    with warnings.catch_warnings(record=True):
        fig = host_sync_figures(_run, set_mode=lambda mode: None, roots=["/nonexistent"])
    assert fig == {"gpu_host_syncs": 0, "gpu_host_sync_sites": []}


def test_the_mode_is_switched_back_when_the_run_fails() -> None:
    modes: list[int] = []

    def failing() -> None:
        _engine_sync()
        raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        host_sync_figures(failing, set_mode=modes.append, roots=[HERE])
    assert modes == [1, 0]


def test_the_engine_is_its_workers_and_cluster_packages() -> None:
    assert sorted(Path(root).name for root in engine_roots()) == ["cluster", "workers"]
