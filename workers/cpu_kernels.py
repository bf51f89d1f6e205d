"""CPU kernels compiled on first use (torch.utils.cpp_extension), with the torch path as fallback.

`paged_decode` (csrc/paged_decode.cpp) attends decode rows straight from the paged KV
cache with an online softmax. The torch path gathers every row's blocks into a padded copy
and then runs SDPA on it, so the KV is read, written and read again; at 64 sequences of
300-500 tokens that was ~60% of a decode step. The kernel reads it once, on every thread:
3.9x faster per layer call on the bench model's shapes (6.1 vs 23.8 ms), close to what
the machine's memory streams.

Compiled once per machine into torch's extension cache (~30 s on 2 cores, then a load in
well under a second). Without a compiler, or with TANDEM_CPU_KERNELS=0, everything runs
the torch path; the outputs agree to float32 rounding (tests/model/test_cpu_kernels.py).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module: Any = None
_tried = False


def paged_decode_kernel() -> Any:
    """The compiled module (its `paged_decode`), or None when it cannot be had here."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
            return None
        try:
            from torch.utils.cpp_extension import load

            source = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")
            logger.info("compiling the CPU paged-decode kernel (once per machine)")
            # -march=native: the name carries the CPU's features, so a build cache shared
            # between different machines (an NFS home) never hands one another's binary.
            # -fopenmp: at::parallel_for is inlined here, and without OpenMP it runs on one
            # thread. It resolves to the libgomp torch has already loaded (same soname).
            # A compiler without OpenMP (Apple's clang) still gets the one-thread build.
            for suffix, openmp, link in (("", "-fopenmp", ["-fopenmp"]), ("_serial", "-fopenmp-simd", [])):
                try:
                    _module = load(f"tandem_paged_decode_{_cpu_tag()}{suffix}", [source], verbose=False,
                                   extra_cflags=["-O3", "-march=native", openmp], extra_ldflags=link)
                    break
                except Exception as exc:  # no compiler, no headers: the torch path serves
                    logger.warning("CPU paged-decode kernel with %s unavailable (%s)", openmp, exc)
            if _module is None:
                logger.warning("CPU paged-decode kernel unavailable; using the torch path")
        except ImportError as exc:
            logger.warning("CPU paged-decode kernel unavailable (%s); using the torch path", exc)
        return _module


def _cpu_tag() -> str:
    """A short digest of this CPU's model and instruction-set flags."""
    import hashlib
    import platform

    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        info += "".join(sorted(set(lines)))
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:10]
