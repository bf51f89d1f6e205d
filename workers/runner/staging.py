"""The one packed int32 buffer a step's inputs travel in, and its views.

A step's host arrays are packed back to back in pinned host memory and sent to the device
with a single non-blocking copy (`StagingBuffer`); the step's tensors are then consecutive
views of that one device buffer (`split_views`), so no input costs a copy of its own.
"""

from __future__ import annotations

import numpy as np
import torch


class StagingBuffer:
    """Pinned host memory for a step's packed inputs, two in turn, each reused only after
    its previous copy has been read (an event per buffer)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, segments: list[np.ndarray], dest: torch.Tensor | None = None) -> torch.Tensor:
        """The segments packed into one int32 array on the device (into `dest` when given)."""
        total = sum(len(s) for s in segments)
        if self.device.type != "cuda":
            packed = torch.from_numpy(np.concatenate(segments).astype(np.int32, copy=False))
            if dest is None:
                return packed
            dest[:total].copy_(packed)
            return dest[:total]
        turn = self._turn = 1 - self._turn
        host = self._host[turn]
        if host is None or host.numel() < total:
            host = self._host[turn] = torch.empty(max(total, 2 * (0 if host is None else host.numel()), 4096),
                                                  dtype=torch.int32, pin_memory=True)
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copy out of this buffer two steps ago has been read
        np.concatenate(segments, out=host[:total].numpy())
        out = dest[:total] if dest is not None else torch.empty(total, dtype=torch.int32, device=self.device)
        out.copy_(host[:total], non_blocking=True)
        if event is None:
            event = self._events[turn] = torch.cuda.Event()
        event.record()
        return out


def split_views(flat, sizes: list[int]) -> list:
    """`flat` (a tensor or a numpy array) cut into consecutive views of `sizes`."""
    views, offset = [], 0
    for size in sizes:
        views.append(flat[offset:offset + size])
        offset += size
    return views
