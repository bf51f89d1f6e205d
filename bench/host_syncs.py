"""Where the engine makes the host wait for the device: one pass under torch's sync debug mode.

Overlapping steps works only while the host never waits for the device except where it means
to (`PendingOutput.result`, one CUDA event a step, which the debug mode does not count). Any
other synchronising operation (`.item()`, `.tolist()` or `.cpu()` of a device tensor,
`torch.tensor(..., device="cuda")` from a host list, a boolean mask) drains the queue in the
middle of launching a step: the device idles while the host finishes that launch. torch
warns at each one in its sync debug mode; the warning is caught where it is raised, so the
line of the engine's code that made the call is known.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from tandem.bench.report import Figures

# torch's warning (c10/cuda/CUDAFunctions.cpp: warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"
FIGURES = ("gpu_host_syncs", "gpu_host_sync_sites")


def engine_roots() -> tuple[str, ...]:
    """The folders of the engine's packages (the benchmark's own syncs are not the engine's)."""
    from tandem import cluster, workers

    return tuple(str(Path(p).resolve()) for package in (workers, cluster) for p in package.__path__)


def host_sync_figures(run: Callable[[], object], set_mode: Callable[[int], None] | None = None,
                      roots: Iterable[str] | None = None, top: int = 8) -> Figures:
    """Run `run()` once with torch's sync debug mode at "warn": `gpu_host_syncs`, how many
    synchronising operations the engine's code (`roots`) made, and `gpu_host_sync_sites`, the
    `top` lines that made them ("path:line function: count", the innermost frame in `roots`).
    `set_mode`: torch.cuda.set_sync_debug_mode unless given."""
    import torch

    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    roots = tuple(roots) if roots is not None else engine_roots()
    sites: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every occurrence, not once per line
        passed_on = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if SYNC_WARNING not in str(message):
                passed_on(message, category, filename, lineno, file, line)
                return
            site = _engine_site(traceback.extract_stack()[:-1], roots)
            if site is not None:
                sites[site] += 1

        warnings.showwarning = record
        set_mode(1)
        try:
            run()
        finally:
            set_mode(0)
    return {"gpu_host_syncs": sum(sites.values()),
            "gpu_host_sync_sites": [f"{site}: {count}" for site, count in sites.most_common(top)]}


def _engine_site(stack: list[traceback.FrameSummary], roots: tuple[str, ...]) -> str | None:
    """The innermost frame of `stack` in the engine's folders, as "folder/file.py:line function"
    (None when the call never passed through the engine)."""
    for frame in reversed(stack):
        path = str(Path(frame.filename).resolve())
        for root in roots:
            if path.startswith(root + "/"):
                return f"{Path(root).name}/{path[len(root) + 1:]}:{frame.lineno} {frame.name}"
    return None
