"""Where this process sits in its group, and the collectives the layers use.

With tp_size == 1 every collective is a no-op, so the single-process engine runs
the same layer code as a sharded worker. A worker calls `init_groups` once
(gloo on CPU, nccl on CUDA) to get its context with the TP and PP subgroups. On CPU a
stage's TP collectives go through shared memory (workers/distributed/shm_comm.py) rather than
gloo's loopback TCP; gloo stays for what does not fit and for stage-to-stage sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.workers.distributed.shm_comm import ShmCommunicator


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks
    pp_group: Any = None  # ProcessGroup of this TP rank's column across stages (send/recv)
    prev_rank: int = -1  # global rank of the same TP rank on the previous / next stage
    next_rank: int = -1
    num_overlap_chunks: int = 1  # > 1: row-parallel all-reduces overlap the next chunk's GEMMs
    # Fewer tokens per chunk than this and a chunk's GEMMs are too short to hide anything
    # (decode steps): the step runs serially instead.
    min_chunk_tokens: int = 32
    skip_collectives: bool = False  # benchmark only: measures compute without communication
    shm: ShmCommunicator | None = None  # CPU TP collectives through shared memory, when set up
    layer_partition: tuple[int, ...] | None = None  # decoder layers per stage as given; None: balanced

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def overlaps_comm(self) -> bool:
        return self.tp_size > 1 and self.num_overlap_chunks > 1

    def partial_sum_buffer(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a row-parallel layer may write the partial sum it all-reduces next, so that
        the all-reduce copies nothing (a shared-memory slot); None: use a tensor of its own."""
        if self.shm is None or self.skip_collectives:
            return None
        return self.shm.claim((rows, cols), dtype)

    def _shm_takes(self, x: torch.Tensor) -> bool:
        """Whether x's collective goes through shared memory (else gloo or NCCL)."""
        return self.shm is not None and self.shm.fits(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over TP ranks: x itself, reduced in place, or a new tensor (shared memory)."""
        if self.tp_size > 1 and not self.skip_collectives:
            if self._shm_takes(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max over TP ranks, in place (once at load: online quantization's
        row-parallel scales see the whole row)."""
        if self.tp_size > 1 and not self.skip_collectives:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.tp_group)
        return x

    def all_reduce_async(self, x: torch.Tensor) -> Any:
        """Start an all-reduce; returns a handle whose wait() returns the sum (None when trivial)."""
        if self.tp_size == 1 or self.skip_collectives:
            return None
        if self._shm_takes(x):
            return self.shm.start_all_reduce(x)
        return _GlooPending(dist.all_reduce(x, group=self.tp_group, async_op=True), x)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice along the last dim (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        if self.skip_collectives:
            return torch.cat([x] * self.tp_size, dim=-1)
        if self._shm_takes(x):
            return self.shm.all_gather_last_dim(x)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


    # ---- stage to stage: each TP rank sends its (replicated) hidden states to its peer ----
    def send_next(self, x: torch.Tensor, tag: int) -> Any:
        """Start sending hidden states to the next stage; wait on the handle before reusing x."""
        return dist.isend(x.contiguous(), dst=self.next_rank, group=self.pp_group, tag=tag)

    def recv_prev(self, buf: torch.Tensor, tag: int) -> Any:
        """Start receiving hidden states from the previous stage into buf."""
        return dist.irecv(buf, src=self.prev_rank, group=self.pp_group, tag=tag)


class _GlooPending:
    """gloo's in-place async all-reduce behind the handle shape shared memory has."""

    def __init__(self, work: Any, x: torch.Tensor) -> None:
        self._work, self._x = work, x

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._x


def init_groups(rank: int, tp_size: int, pp_size: int, backend: str, init_method: str,
                timeout_s: float = 300.0, shm_slot_bytes: int = 0, **kwargs: Any) -> ParallelContext:
    """Join the group's default process group, then build the TP and PP subgroups.

    Global rank = pp_rank * tp_size + tp_rank. Every rank creates every subgroup, in the
    same order (torch.distributed requires it), and keeps the ones it belongs to.
    With gloo and shm_slot_bytes > 0, each stage's TP ranks also set up shared-memory
    collectives for tensors up to that size (None where they are not on one node).
    """
    from datetime import timedelta

    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = pp_group = None
    for stage in range(pp_size):
        group = dist.new_group([stage * tp_size + t for t in range(tp_size)])
        if stage == pp_rank:
            tp_group = group
    for t in range(tp_size):
        group = dist.new_group([stage * tp_size + t for stage in range(pp_size)])
        if t == tp_rank:
            pp_group = group
    ctx = ParallelContext(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, tp_group=tp_group,
        pp_group=pp_group, prev_rank=rank - tp_size if pp_rank > 0 else -1,
        next_rank=rank + tp_size if pp_rank < pp_size - 1 else -1, **kwargs)
    if backend == "gloo" and tp_size > 1 and shm_slot_bytes > 0:
        # As many ops in flight as the overlapped layers keep (one per chunk), at least 2.
        ctx.shm = ShmCommunicator.create(tp_group, tp_rank, tp_size, shm_slot_bytes,
                                         max_outstanding=max(2, ctx.num_overlap_chunks), timeout_s=timeout_s)
    return ctx


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's even share of `total` (which must divide evenly)."""
    assert total % size == 0, f"{total} does not split evenly over {size} ranks"
    per = total // size
    return rank * per, (rank + 1) * per
