"""The garbage collector's pauses during a run, from `gc.callbacks`.

A collection stops the host: while it walks the heap no step is launched, so on a GPU every
millisecond of it can be a millisecond the GPU idles. A benchmark reports how long the
collections of its tandem runs took in all, the longest one, and how many reached the oldest
generation (the ones that walk the whole heap not frozen; `workers/startup_heap.py`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class GcPauses:
    total_s: float = 0.0
    longest_s: float = 0.0
    collections: int = 0
    oldest_collections: int = 0  # of generation 2
    _start: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        if self._start is None:  # entered mid-collection
            return
        pause = time.perf_counter() - self._start
        self._start = None
        self.total_s += pause
        self.longest_s = max(self.longest_s, pause)
        self.collections += 1
        self.oldest_collections += info["generation"] == 2
