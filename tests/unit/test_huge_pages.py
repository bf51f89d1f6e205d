"""Huge pages for the CPU KV cache: zeros of the right shape either way, and on Linux with
transparent huge pages allowed the mapping really is backed by 2 MiB pages."""

from __future__ import annotations

import sys

import torch

from tandem.workers.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, zeros_huge


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def _huge_bytes_under(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings under `tensor` (from /proc/self/smaps). madvise splits a
    mapping at the huge-page boundaries, so the tensor spans several."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    inside, huge = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                huge += int(line.split()[1]) * 1024
    return huge


def test_zeros_huge_is_zeros() -> None:
    t = zeros_huge((3 * HUGE_PAGE_BYTES // 4 + 5, 2), torch.float32)  # not a whole number of pages
    assert t.shape == (3 * HUGE_PAGE_BYTES // 4 + 5, 2) and t.dtype == torch.float32
    assert not t.any()


def test_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages(torch.empty(1024)) is False


def test_the_cache_gets_huge_pages_where_the_kernel_allows() -> None:
    t = zeros_huge((16 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 32 MiB
    if sys.platform.startswith("linux") and _thp_mode() in ("madvise", "always"):
        assert _huge_bytes_under(t) >= 8 * HUGE_PAGE_BYTES
    assert not t.any()
