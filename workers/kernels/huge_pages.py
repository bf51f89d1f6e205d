"""Large host tensors backed by transparent huge pages (Linux), to spare the TLB.

The CPU decode kernel reads each sequence's KV blocks from wherever they sit in a cache of
hundreds of MB. With 4 KiB pages every 32 KiB block touches eight pages and the page walks
stall the loads; 2 MiB pages (THP set to "madvise", the common default) spare most of them
(figures in bench/RESULTS.md).

`empty_huge` maps fresh pages with MADV_HUGEPAGE before anything touches them; elsewhere, or
when the kernel refuses, it is a plain `torch.empty`. Nothing depends on getting huge pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 4 * HUGE_PAGE_BYTES  # smaller tensors gain nothing worth a syscall


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages `tensor` spans. Pages already touched
    keep their size (khugepaged may merge them later); True if the kernel accepted."""
    size = tensor.numel() * tensor.element_size()
    if _LIBC is None or tensor.device.type != "cpu" or size < _MIN_BYTES:
        return False
    ptr = tensor.data_ptr()
    start = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (ptr + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    if _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros` on the CPU, with huge pages asked for before the zeros touch them."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()
