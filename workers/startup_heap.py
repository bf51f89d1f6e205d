"""The start-up heap, kept out of the garbage collector's way while an engine serves.

Start-up leaves a few hundred thousand long-lived Python objects behind (torch's and
transformers' modules, the model's layers, Ray's and Serve's state). CPython's oldest
generation holds all of them, and a collection of it walks every one: that collection comes
whenever enough new objects have outlived two younger collections, as a run's requests and
outputs do, and it stops the host for 160-240 ms on the 2-core CI machine (330,000 objects
after an `LLM` start). No step is launched meanwhile, so the GPU idles and every stream stalls.

After start-up an engine collects once and freezes what is left (`gc.freeze`: the permanent
generation, which no collection walks), as vLLM's engine core and SGLang do. Later
collections walk only what serving allocated since. The freeze is process-wide and shared
by the engines in the process; one shutting down thaws it while its own parts are freed.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0


class StartupHeap:
    """One engine's hold on the frozen start-up heap."""

    def __init__(self) -> None:
        global _holders
        with _lock:
            gc.collect()  # start-up's garbage is freed, not frozen for good
            gc.freeze()
            _holders += 1
        self._held = True

    @contextmanager
    def released(self) -> Iterator[None]:
        """Let go of the heap around an engine's shutdown. Inside, the heap is thawed, so the
        collection that gives the engine's device memory back (`gpu_memory.release`) reaches
        the reference cycles start-up froze; after, it is frozen again if another engine in
        this process still holds it."""
        global _holders
        with _lock:
            if self._held:
                self._held = False
                _holders -= 1
                gc.unfreeze()
        try:
            yield
        finally:
            with _lock:
                if _holders > 0:
                    gc.freeze()


def holders() -> int:
    """Engines in this process holding the heap frozen (tests)."""
    return _holders
