"""Every live request's KV block ids in one int32 array, a row per request.

The rows follow the step diffs (a few new blocks every block_size tokens), so a step's
block tables are one fancy-index of this array, not a Python loop over requests and
their block lists. Rows past a request's last block hold stale ids that nothing reads:
the kernels read ceil(seq_len / block_size) entries of a row.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, width: int, num_rows: int = 64) -> None:
        self.width = width  # most blocks one request can hold
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A row for a new request, holding its blocks; returns the row."""
        if not self._free_rows:
            grown = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free_rows = list(range(2 * grown - 1, grown - 1, -1))
        row = self._free_rows.pop()
        self.table[row, :len(block_ids)] = block_ids
        return row

    def update(self, row: int, num_kept: int, new_block_ids: list[int]) -> None:
        """The row's blocks past num_kept are replaced by new_block_ids (a step's diff)."""
        if new_block_ids:
            self.table[row, num_kept:num_kept + len(new_block_ids)] = new_block_ids

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def rows(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width]: the first `width` blocks of each row, a copy."""
        return self.table[rows, :width]
