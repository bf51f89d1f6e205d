"""Huge pages for the CPU KV cache: zeros of the right shape either way, and on Linux the
tensor's whole 2 MiB pages are advised (MADV_HUGEPAGE) before anything touches them."""

from __future__ import annotations

import sys

import torch

from tandem.workers.kernels.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, zeros_huge


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def _mappings_under(tensor: torch.Tensor) -> list[dict[str, str]]:
    """The /proc/self/smaps entries of the mappings under `tensor`. madvise splits a mapping at
    the huge-page boundaries, so the tensor spans several."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    found: list[dict[str, str]] = []
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
                if inside:
                    found.append({"range": head})
            elif inside:
                found[-1][head.rstrip(":")] = line.split(":", 1)[1].strip()
    return found


def test_zeros_huge_is_zeros() -> None:
    t = zeros_huge((3 * HUGE_PAGE_BYTES // 4 + 5, 2), torch.float32)  # not a whole number of pages
    assert t.shape == (3 * HUGE_PAGE_BYTES // 4 + 5, 2) and t.dtype == torch.float32
    assert not t.any()


def test_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages(torch.empty(1024)) is False


def test_the_cache_is_advised_onto_huge_pages_on_linux() -> None:
    t = zeros_huge((16 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 32 MiB
    assert not t.any()
    if not sys.platform.startswith("linux") or _thp_mode() == "unavailable":
        return
    # "hg" marks a MADV_HUGEPAGE range: every whole 2 MiB page of the tensor is in one. (How
    # many the kernel actually backs with huge pages depends on its free memory, not on us.)
    advised = [m for m in _mappings_under(t) if "hg" in m.get("VmFlags", "").split()]
    lo, hi = (int(x, 16) for x in advised[0]["range"].split("-")) if len(advised) == 1 else (0, 0)
    assert len(advised) == 1 and hi - lo >= 15 * HUGE_PAGE_BYTES, _mappings_under(t)
