"""Shared-memory collectives for the TP ranks of a stage on one CPU node.

Placement packs a stage's TP ranks on one node, so on CPU their all-reduces never need
a network. gloo still sends them through loopback TCP, paying kernel copies and thread
hand-offs on the same cores that compute (figures in bench/RESULTS.md). Here each rank
instead writes its partial sum
into its own slot of a shared-memory ring and tells each peer through a FIFO (one byte
per op); a peer that needs the result reads that byte (blocking, no spinning) and sums
the slots itself, in rank order, so every rank ends with bit-identical values.

    rank r:  copy x -> slot[r][seq % depth]   write 1 byte to each peer   ... other work ...
             read 1 byte from each peer       x = slot[0] + slot[1] + ... (rank order)

An op is *started* (published) and later *completed* (peers' bytes read, slots summed);
between the two a rank is free to compute, which is what the overlapped layers do.
Ops complete in the order they started (completing op t completes every earlier one), so
a rank that has completed op t knows every peer has completed op t - depth/2 or later
(a peer publishes op t only after completing op t - max_outstanding). With depth =
2 * max_outstanding slots, a slot is never overwritten before every peer has read it.
Tensors larger than a slot, and groups whose ranks cannot see each other's files (not
one node after all), fall back to gloo.

A producer can skip the copy: `claim(shape, dtype)` hands out the slot the next op will
publish from, the row-parallel GEMM writes its partial sum straight into it, and
publishing that very tensor copies nothing. The sum then goes to a new tensor (peers still
read the slot), so callers use what `wait()` / `all_reduce()` return.

A peer that exits closes its FIFOs: the byte read returns EOF and the op fails loudly
instead of waiting for gloo's timeout.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import select
import shutil
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_ALIGN = 64  # slot offsets stay cache-line aligned for every dtype


@dataclass
class _Op:
    seq: int
    like: torch.Tensor | None  # this rank's contribution (its shape and dtype are the slots'); None once done
    gather: bool = False
    result: torch.Tensor | None = None  # the sum (all-reduce) or concatenation (all-gather)


class ShmHandle:
    """What `start_all_reduce` returns; `wait()` completes the op (and any earlier ones)
    and returns its result."""

    def __init__(self, comm: ShmCommunicator, op: _Op) -> None:
        self._comm, self._op = comm, op

    def wait(self) -> torch.Tensor:
        self._comm._complete_through(self._op.seq)
        return self._op.result


class ShmCommunicator:
    def __init__(self, rank: int, size: int, slots: list[torch.Tensor], slot_bytes: int, max_outstanding: int,
                 fds_in: dict[int, int], fds_out: dict[int, int], timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self._slots = slots  # per rank: a uint8 tensor of depth * slot_bytes, mapped shared
        self.slot_bytes = slot_bytes
        self.max_outstanding = max_outstanding
        self.depth = 2 * max_outstanding
        self._fds_in, self._fds_out = fds_in, fds_out
        self._polls = {src: _poller(fd) for src, fd in fds_in.items()}  # poll, not select: any fd number
        self._timeout_s = timeout_s
        self._next_seq = 0
        self._outstanding: collections.deque[_Op] = collections.deque()
        self._claimed: tuple[int, torch.Tensor] | None = None  # (seq, my slot's view) handed out
        self._views: dict[tuple, torch.Tensor] = {}  # slot views by (rank, slot, shape, dtype)

    # ---- set-up ------------------------------------------------------------------------------------
    @classmethod
    def create(cls, group: dist.ProcessGroup, rank: int, size: int, slot_bytes: int, max_outstanding: int = 4,
               timeout_s: float = 300.0) -> ShmCommunicator | None:
        """Collective over `group`: every rank calls it. None (use gloo) when the ranks do not
        share a shared-memory file system or it has no room for the ring."""
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        names = [tempfile.mkdtemp(prefix="tandem-tp-", dir=root) if rank == 0 else None]
        dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
        directory: str = names[0]
        depth = 2 * max_outstanding
        slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        ok = True
        try:
            if rank != 0 and not os.path.isdir(directory):
                raise FileNotFoundError(f"{directory} (rank 0 is on another node)")
            path = os.path.join(directory, f"slots{rank}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, depth * slot_bytes)  # fails now, not with SIGBUS later
            finally:
                os.close(fd)
            for src in range(size):
                if src != rank:
                    os.mkfifo(os.path.join(directory, f"fifo{src}to{rank}"), 0o600)
        except OSError as e:
            logger.warning("TP rank %d: no shared-memory collectives (%s); using gloo", rank, e)
            ok = False
        if not _all_agree(ok, group):
            _remove(directory, rank)
            return None
        # A FIFO's write end opens only once its read end is open: read ends first.
        fds_in = {src: os.open(os.path.join(directory, f"fifo{src}to{rank}"), os.O_RDONLY | os.O_NONBLOCK)
                  for src in range(size) if src != rank}
        dist.barrier(group=group)
        fds_out = {dst: os.open(os.path.join(directory, f"fifo{rank}to{dst}"), os.O_WRONLY)
                   for dst in range(size) if dst != rank}
        for fd in fds_in.values():
            os.set_blocking(fd, True)
        slots = [torch.from_file(os.path.join(directory, f"slots{r}"), shared=True, size=depth * slot_bytes,
                                 dtype=torch.uint8) for r in range(size)]
        dist.barrier(group=group)
        _remove(directory, rank)  # every rank holds its mappings and FIFO ends: names no longer needed
        return cls(rank, size, slots, slot_bytes, max_outstanding, fds_in, fds_out, timeout_s)

    # ---- collectives ------------------------------------------------------------------------------
    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def claim(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The slot the next op publishes from, to compute a partial sum into (None: too big).
        Publishing exactly this tensor as the next op then copies nothing."""
        if math.prod(shape) * dtype.itemsize > self.slot_bytes:
            return None
        self._make_room()
        view = self._slot(self.rank, self._next_seq, shape, dtype)
        self._claimed = (self._next_seq, view)
        return view

    def start_all_reduce(self, x: torch.Tensor) -> ShmHandle:
        """Publish x's partial sum; the handle's wait() returns the sum over ranks."""
        return ShmHandle(self, self._publish(x, gather=False))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.start_all_reduce(x).wait()

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return ShmHandle(self, self._publish(x, gather=True)).wait()

    # ---- internals --------------------------------------------------------------------------------
    def _slot(self, rank: int, seq: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (rank, seq % self.depth, tuple(shape), dtype)
        view = self._views.get(key)
        if view is None:  # a step reuses a handful of shapes: build each view once
            if len(self._views) > 1024:
                self._views.clear()
            start = (seq % self.depth) * self.slot_bytes
            nbytes = math.prod(shape) * dtype.itemsize
            view = self._slots[rank][start:start + nbytes].view(dtype).view(shape)
            self._views[key] = view
        return view

    def _in_my_ring(self, x: torch.Tensor) -> bool:
        base = self._slots[self.rank].data_ptr()
        return base <= x.data_ptr() < base + self.depth * self.slot_bytes

    def _make_room(self) -> None:
        if len(self._outstanding) >= self.max_outstanding:
            self._complete_through(self._outstanding[0].seq)  # keeps the ring's reuse rule

    def _publish(self, x: torch.Tensor, gather: bool) -> _Op:
        claimed, self._claimed = self._claimed, None
        is_claimed = claimed is not None and claimed[1].data_ptr() == x.data_ptr() and claimed[1].shape == x.shape
        if is_claimed and claimed[0] == self._next_seq:
            pass  # computed in place: nothing to copy
        else:
            if self._in_my_ring(x):  # its slot may hold another op's bytes by now
                raise RuntimeError("a claimed shared-memory slot was published after another op")
            self._make_room()
            self._slot(self.rank, self._next_seq, x.shape, x.dtype).copy_(x)
        op = _Op(self._next_seq, x, gather)
        self._next_seq += 1
        for dst, fd in self._fds_out.items():
            try:
                os.write(fd, b"\x01")  # a syscall: the slot's bytes are visible to the peer before it
            except BrokenPipeError:
                raise RuntimeError(f"TP rank {dst} exited in the middle of a collective") from None
        self._outstanding.append(op)
        return op

    def _complete_through(self, seq: int) -> None:
        while self._outstanding and self._outstanding[0].seq <= seq:
            op = self._outstanding.popleft()
            for src in self._fds_in:
                self._await_byte(src)
            parts = [self._slot(r, op.seq, op.like.shape, op.like.dtype) for r in range(self.size)]
            if op.gather:
                op.result = torch.cat(parts, dim=-1)
            else:  # rank order on every rank: the same floating-point sum everywhere
                op.result = parts[0] + parts[1]
                for part in parts[2:]:
                    op.result.add_(part)
            op.like = None  # the caller's tensor need not outlive the op

    def _await_byte(self, src: int) -> None:
        if not self._polls[src].poll(self._timeout_s * 1000):
            raise TimeoutError(f"TP rank {src} sent nothing for {self._timeout_s:.0f} s")
        if not os.read(self._fds_in[src], 1):
            raise RuntimeError(f"TP rank {src} exited in the middle of a collective")


def _poller(fd: int) -> select.poll:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller


def _all_agree(ok: bool, group: dist.ProcessGroup) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _remove(directory: str, rank: int) -> None:
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
