"""Where this process sits in its group, and the collectives the layers use.

With tp_size == 1 every collective is a no-op, so the single-process engine runs
the same layer code as a sharded worker. Process groups are created by the
worker (gloo on CPU, nccl on CUDA); this module only uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks
    skip_collectives: bool = False  # benchmark only: measures compute without communication

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and not self.skip_collectives:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_reduce_async(self, x: torch.Tensor) -> Any:
        """Start an all-reduce in place; returns a handle to wait on (None when trivial)."""
        if self.tp_size == 1 or self.skip_collectives:
            return None
        return dist.all_reduce(x, group=self.tp_group, async_op=True)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice along the last dim (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        if self.skip_collectives:
            parts = [x] * self.tp_size
        else:
            dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's even share of `total` (which must divide evenly)."""
    assert total % size == 0, f"{total} does not split evenly over {size} ranks"
    per = total // size
    return rank * per, (rank + 1) * per


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers a pipeline stage holds; earlier stages take the extra."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
