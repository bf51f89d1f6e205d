"""CPU kernels compiled on first use (torch.utils.cpp_extension), with the torch path as fallback.

One extension module (csrc/module.cpp) holds:

- `paged_decode` (csrc/paged_decode.cpp) attends decode rows straight from the paged KV
  cache with an online softmax. The torch path gathers every row's blocks into a padded
  copy and then runs SDPA on it, so the KV is read, written and read again. The kernel
  reads it once, on every thread, close to what the machine's memory streams (figures in
  bench/RESULTS.md).
- `argmax_rows`, `rope_`, `rms_norm` (csrc/rows.cpp): one pass per row where torch runs
  a handful of ops, each a dispatch and a trip through memory.

Compiled once per machine into torch's extension cache (under a minute, then a load in
well under a second). Without a compiler, or with TANDEM_CPU_KERNELS=0, everything runs
the torch path; the outputs agree to float32 rounding (tests/model/test_cpu_kernels.py).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")


class CompiledExtension:
    """A C++ extension from csrc/, built on first use and then loaded from torch's extension
    cache; `get()` is the module, or None where it cannot be had (TANDEM_CPU_KERNELS=0, no
    compiler, or `usable()` says no). Builds are tried in `variants` order, each a (name
    suffix, compile flags, link flags), and the first that builds wins."""

    def __init__(self, what: str, name: str, sources: tuple[str, ...], fallback: str,
                 variants: tuple[tuple[str, list[str], list[str]], ...],
                 usable: Callable[[], bool] = lambda: True) -> None:
        self.what, self.name, self.fallback = what, name, fallback
        self.sources = [os.path.join(_CSRC, source) for source in sources]
        self.variants = variants
        self.usable = usable
        self._lock = threading.Lock()
        self._module: Any = None
        self._tried = False

    def get(self) -> Any:
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                self._tried = True
                if os.environ.get("TANDEM_CPU_KERNELS", "1") != "0" and self.usable():
                    self._module = self._build()
            return self._module

    def _build(self) -> Any:
        tag = build_tag(self.sources)
        for suffix, cflags, ldflags in self.variants:
            try:
                return build_extension(self.what, f"{self.name}_{tag}{suffix}", self.sources,
                                       extra_cflags=cflags, extra_ldflags=ldflags)
            except Exception as exc:  # no compiler, no headers, a missing symbol: try the next
                logger.warning("building %s with %s failed (%s)", self.what, " ".join(cflags), exc)
        logger.warning("%s unavailable; %s", self.what, self.fallback)
        return None


# -march=native: the name carries the CPU's features (and the sources' digest), so a build
# cache shared between machines never hands one another's binary. -fopenmp: at::parallel_for
# is inlined here, and without OpenMP it runs on one thread; it resolves to the libgomp torch
# has already loaded (same soname). A compiler without OpenMP (Apple's clang) still gets the
# one-thread build.
_KERNELS = CompiledExtension(
    "the CPU kernels", "tandem_cpu_kernels", ("module.cpp", "paged_decode.cpp", "rows.cpp"), "using the torch path",
    variants=(("", ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"]),
              ("_serial", ["-O3", "-march=native", "-fopenmp-simd"], [])))

# The kernels the model's hot paths use (attention, layers, sampler), or None for the torch
# path. Set once per process when a CPU float32 model loads (ModelRunner.load_model).
ACTIVE: Any = None


def activate() -> Any:
    """Switch this process's hot paths to the compiled kernels, where they can be had."""
    global ACTIVE
    ACTIVE = compiled_kernels()
    return ACTIVE


def active_for(t: Any) -> Any:
    """The kernels if they are on and `t` is a CPU float32 tensor they take, else None."""
    kernels = ACTIVE
    if kernels is not None and t.dtype == torch.float32 and t.device.type == "cpu":
        return kernels
    return None


def compiled_kernels() -> Any:
    """The compiled module, or None when it cannot be had here."""
    return _KERNELS.get()


def build_extension(what: str, name: str, sources: list[str], **options: Any) -> Any:
    """torch.utils.cpp_extension.load, with a progress line while it compiles. A cached build
    loads in well under a second; a first build takes ~30-60 s on 2 cores, so after 2 s
    without a result the wait is shown (model loading otherwise goes silent)."""
    from torch.utils.cpp_extension import load
    from tqdm.auto import tqdm

    done = threading.Event()
    # Redrawn in place on a terminal; in a log (a Ray worker's) every redraw is a line.
    redraw_s = 0.5 if sys.stderr.isatty() else 15.0

    def show() -> None:
        if done.wait(2.0):
            return
        logger.info("compiling %s (once per machine)", what)
        with tqdm(desc=f"compiling {what} (once per machine)", bar_format="{desc}: {elapsed}") as bar:
            while not done.wait(redraw_s):
                bar.refresh()

    watcher = threading.Thread(target=show, name="extension-build-progress", daemon=True)
    watcher.start()
    try:
        return load(name, sources, verbose=False, **options)
    finally:
        done.set()
        watcher.join()


def build_tag(sources: list[str]) -> str:
    """A short digest of this CPU's model and instruction-set flags, of `sources` (their paths and
    contents) and of the headers beside them (torch's cache notices changed sources, not headers).
    The paths keep two checkouts on one machine in builds of their own: torch's build file names
    its sources, so each would otherwise rebuild the other's (~45 s a turn)."""
    digest = hashlib.sha1(platform.machine().encode())
    digest.update("\0".join(os.path.abspath(path) for path in sources).encode())
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        digest.update("".join(sorted(set(lines))).encode())
    except OSError:
        pass
    for path in [*sources, *sorted(glob.glob(os.path.join(_CSRC, "*.h")))]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:10]
