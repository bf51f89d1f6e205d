"""Shared-memory TP collectives (workers/distributed/shm_comm.py) in real processes over gloo: gloo's
values (bit for bit at two ranks), identical on every rank; ops in flight beyond the ring's depth; the
gloo fallback for tensors larger than a slot and for ranks that cannot share files; a
peer that exits fails the op at once; nothing is left in /dev/shm."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from tandem.cluster.net import free_port

SLOT_BYTES = 64 * 64 * 4  # a 64 x 64 float32 tensor fills a slot exactly


def _spawn(size: int, target: Callable[..., None], *extra: Any, num_answers: int | None = None,
           timeout_s: float = 120.0) -> list[tuple[int, bool, Any]]:
    """target(rank, size, init, queue, *extra) on `size` spawned ranks; the first
    `num_answers` (default: all) (rank, ok, value) answers they put on the queue."""
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn.Process(target=target, args=(rank, size, init, queue, *extra)) for rank in range(size)]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=timeout_s) for _ in range(size if num_answers is None else num_answers)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _run(size: int, body: Callable[..., Any], *args: Any) -> list[Any]:
    """body(ctx, *args) on `size` spawned ranks of a TP group; returns each rank's result."""
    results: dict[int, Any] = {}
    for rank, ok, value in _spawn(size, _rank_main, body, args):
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results[rank] = value
    return [results[r] for r in range(size)]


def _own_shm_dirs(test_pid: int) -> str:
    """Where the shared-memory directories of the ranks a test process spawns go (a glob)."""
    return f"/dev/shm/tandem-tp-{test_pid}-*"


def _name_shm_dirs_after_the_test() -> None:
    """A rank's shared-memory directory takes the spawning test process's pid in its name, so
    that checking what the test left in /dev/shm sees no other process's directories (a TP
    group of a test running beside this one makes and removes its own)."""
    import tempfile

    real = tempfile.mkdtemp

    def mkdtemp(suffix: str | None = None, prefix: str | None = None, dir: str | None = None) -> str:
        if prefix == "tandem-tp-":
            prefix = f"{prefix}{os.getppid()}-"
        return real(suffix, prefix, dir)

    tempfile.mkdtemp = mkdtemp


def _rank_main(rank: int, size: int, init: str, queue: Any, body: Callable[..., Any], args: tuple) -> None:
    import torch

    from tandem.workers.distributed.parallel import init_groups

    torch.set_num_threads(1)
    _name_shm_dirs_after_the_test()
    try:
        ctx = init_groups(rank, size, 1, "gloo", init, timeout_s=60, shm_slot_bytes=SLOT_BYTES,
                          num_overlap_chunks=2)
        queue.put((rank, True, body(ctx, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, False, traceback.format_exc()))


# ---- bodies (module level: spawned processes import them) -------------------------------------
def _values(rank: int, shape: tuple[int, ...], dtype: Any, salt: int = 0) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randn(*shape, generator=gen).to(dtype)


def _reduce_like_gloo(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    assert ctx.shm is not None
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((64, 64), (3, 5), (1, 64)):
            x = _values(ctx.tp_rank, shape, dtype)
            ref = x.clone()
            dist.all_reduce(ref, group=ctx.tp_group)
            x = ctx.all_reduce(x)
            out[f"{dtype}-{shape}"] = (_same_sum(x, ref, ctx.tp_size), x.float().tolist())
    # Larger than a slot: gloo, same result.
    big = _values(ctx.tp_rank, (65, 64), torch.float32)
    assert not ctx.shm.fits(big)
    ref = big.clone()
    dist.all_reduce(ref, group=ctx.tp_group)
    big = ctx.all_reduce(big)
    out["big"] = (_same_sum(big, ref, ctx.tp_size), big.tolist())
    # Vocab-parallel logits: each rank's slice, concatenated in rank order.
    gathered = ctx.all_gather_last_dim(_values(ctx.tp_rank, (4, 8), torch.float32, salt=7))
    expected = torch.cat([_values(r, (4, 8), torch.float32, salt=7) for r in range(ctx.tp_size)], dim=-1)
    out["gather"] = (torch.equal(gathered, expected), gathered.tolist())
    return out  # plain lists: torch's queue pickling would share memory with a process that exits


def _same_sum(x: Any, ref: Any, size: int) -> bool:
    """Two ranks: a + b either way, bit for bit. More: gloo adds in its own order, so the
    last bit may differ (shared memory adds in rank order on every rank)."""
    import torch

    if size == 2:
        return torch.equal(x, ref)
    tol = 1e-6 if x.dtype == torch.float32 else 2e-2
    return torch.allclose(x.float(), ref.float(), rtol=tol, atol=tol)


def _many_in_flight(ctx: Any, wait_order: str) -> list[bool]:
    """More ops in flight than the ring's depth, waited on in order or newest first."""
    import torch

    shm = ctx.shm
    num_ops = 3 * shm.depth + 1
    xs = [_values(ctx.tp_rank, (8, 16), torch.float32, salt=i) for i in range(num_ops)]
    expected = [sum(_values(r, (8, 16), torch.float32, salt=i) for r in range(ctx.tp_size)) for i in range(num_ops)]
    handles = [ctx.all_reduce_async(x) for x in xs]
    sums = [h.wait() for h in (handles if wait_order == "in_order" else reversed(handles))]
    if wait_order != "in_order":
        sums.reverse()
    return [torch.allclose(s, e, rtol=0, atol=1e-5) for s, e in zip(sums, expected)]


def _claimed_slots(ctx: Any) -> dict[str, Any]:
    """A partial sum computed straight into the next slot; a claim gone stale fails loudly."""
    import torch

    a = _values(ctx.tp_rank, (16, 8), torch.float32)
    w = _values(ctx.tp_rank, (8, 32), torch.float32, salt=3)
    buf = ctx.partial_sum_buffer(16, 32, torch.float32)
    expected = sum(_values(r, (16, 8), torch.float32) @ _values(r, (8, 32), torch.float32, salt=3)
                   for r in range(ctx.tp_size))
    in_place = ctx.all_reduce(torch.mm(a, w, out=buf))
    too_big = ctx.partial_sum_buffer(65, 64, torch.float32)
    stale = ctx.partial_sum_buffer(2, 2, torch.float32)
    stale.fill_(1.0)
    ctx.all_reduce(torch.ones(2, 2))  # another op takes the claimed slot first
    try:
        ctx.all_reduce(stale)
        stale_error = ""
    except RuntimeError as e:
        stale_error = str(e)
    return {"in_place_ok": torch.allclose(in_place, expected, rtol=0, atol=1e-4), "too_big": too_big is None,
            "stale_error": stale_error}


def _exit_or_reduce(ctx: Any) -> str:
    import torch

    if ctx.tp_rank == 1:
        os._exit(0)  # dies holding its FIFO ends: no goodbye, no gloo
    try:
        ctx.all_reduce(torch.ones(4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _setup_elsewhere(ctx: Any) -> bool:
    return ctx.shm is None


def _blind_rank_main(rank: int, size: int, init: str, queue: Any) -> None:
    """Rank 1 cannot see rank 0's files, as on another node."""
    import os.path

    if rank == 1:
        real = os.path.isdir
        os.path.isdir = lambda p: False if "tandem-tp-" in str(p) else real(p)
    _rank_main(rank, size, init, queue, _setup_elsewhere, ())


# ---- tests ----------------------------------------------------------------------------------------
@pytest.fixture
def shm_dirs_removed():
    """The test's ranks leave none of their shared-memory directories behind."""
    yield
    assert glob.glob(_own_shm_dirs(os.getpid())) == []


@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_and_gather_equal_gloo_on_every_rank(size: int, shm_dirs_removed) -> None:
    results = _run(size, _reduce_like_gloo)
    for key in results[0]:
        for rank in range(size):
            assert results[rank][key][0], f"rank {rank}: {key} differs from gloo"
            assert results[rank][key][1] == results[0][key][1], f"ranks disagree on {key}"


@pytest.mark.parametrize("wait_order", ["in_order", "newest_first"])
def test_ops_in_flight_beyond_the_ring_depth(wait_order: str, shm_dirs_removed) -> None:
    for rank_ok in _run(2, _many_in_flight, wait_order):
        assert all(rank_ok)


def test_a_partial_sum_computed_in_its_slot(shm_dirs_removed) -> None:
    for result in _run(2, _claimed_slots):
        assert result == {"in_place_ok": True, "too_big": True,
                          "stale_error": "a claimed shared-memory slot was published after another op"}


def test_a_peer_that_exits_fails_the_op(shm_dirs_removed) -> None:
    # Rank 1 never reports (it exited); rank 0's answer is all we wait for.
    [(rank, ok, message)] = _spawn(2, _rank_main, _exit_or_reduce, (), num_answers=1)
    assert (rank, ok) == (0, True)
    assert message == "TP rank 1 exited in the middle of a collective"


def test_ranks_that_cannot_share_files_use_gloo(shm_dirs_removed) -> None:
    assert sorted(_spawn(2, _blind_rank_main)) == [(0, True, True), (1, True, True)]
