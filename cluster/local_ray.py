"""Starting a Ray on this machine (once more when its start timed out), and stopping it with
nothing of it left running.

Ray's raylet waits a fixed 30 s for its dashboard agent (a Python process that imports some
hundreds of modules) to write its port file, and `ray.init` a fixed 30 s for the raylet to
register. On a loaded host with cold file caches the agent can take longer: the raylet aborts
and `ray.init` raises "The current node timed out during startup". A second start finds those
imports cached. The failed start's processes (the GCS, the dashboard, the agents) would stay
behind with their ports and memory: they are this process's new descendants, ended first.

`ray.shutdown()` ends the Ray's own processes, and they end their workers, but not always what
a worker started: Serve's HAProxy runs as a child of its proxy actor, and one started by a
reload can outlive both (reparented to init, still listening on the server's port and
health-checking its old replica's port, which a later Ray's replica can take, and then
forwarding there). `stop_local_ray` ends whatever of that Ray's process tree outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

logger = logging.getLogger(__name__)

# What Ray's Node says when its raylet did not register in time (ray/_private/node.py).
STARTUP_TIMEOUT = "timed out during startup"
END_WAIT_S = 5.0  # SIGTERM, then SIGKILL what is left after this long


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init(**init_kwargs)` for a Ray this process starts, started once more (its first
    try's processes ended) if the first timed out during startup. Any other error, or a second
    timeout, is raised."""
    import ray

    before = descendants(os.getpid())
    try:
        ray.init(**init_kwargs)
        return
    except Exception as exc:
        if STARTUP_TIMEOUT not in str(exc):
            raise
        logger.warning("tandem: Ray's start timed out (%s); ending what it started and starting it once more",
                       str(exc).split(".")[0])
    end_processes(descendants(os.getpid()) - before)
    ray.shutdown()  # the half-made driver state, if any
    ray.init(**init_kwargs)


def stop_local_ray() -> None:
    """`ray.shutdown()`, then the end of any process below the Ray this process started that
    is still running (none below a Ray it only connected to)."""
    import ray

    tree = _ray_process_tree()
    ray.shutdown()
    end_processes({pid for pid, since in tree.items() if started_at(pid) == since})


def _ray_process_tree() -> dict[int, int]:
    """{pid: start time} of the processes of the Ray this process started (the GCS, the raylet,
    ...) and of everything below them: their workers and what those started."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    roots = {info.process.pid for infos in getattr(node, "all_processes", {}).values() for info in infos}
    pids = roots | descendants(*roots)
    return {pid: since for pid in pids if (since := started_at(pid)) is not None}


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (the state, the parent, ...), or None if the
    process has ended. The command name before them is in parentheses and may hold spaces."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def started_at(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot: with the pid, one process's identity, since
    pids are reused); None if it is not running (ended, or a zombie)."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def descendants(*roots: int) -> set[int]:
    """Every live process below `roots` (children, theirs, ...), from one read of /proc; empty
    without it."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux
        return set()
    for entry in entries:
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def end_processes(pids: set[int]) -> None:
    """SIGTERM `pids`, SIGKILL those still alive after END_WAIT_S; this process's children
    among them are reaped."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + END_WAIT_S
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if running(pid)}
        if alive:
            time.sleep(0.1)
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    for pid in pids:
        try:
            os.waitpid(pid, 0 if pid in alive else os.WNOHANG)
        except ChildProcessError:  # not ours (a grandchild), or reaped already
            pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def running(pid: int) -> bool:
    """Running: not ended, and not a zombie waiting to be reaped (a child ended is one, so
    it is reaped here)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    return started_at(pid) is not None
