"""Starting a Ray on this machine, and starting it once more when its start timed out.

Ray's raylet waits a fixed 30 s for its dashboard agent (a Python process that imports some
hundreds of modules) to write its port file, and `ray.init` a fixed 30 s for the raylet to
register. On a loaded host with cold file caches the agent can take longer: the raylet aborts
and `ray.init` raises "The current node timed out during startup". A second start finds those
imports cached. The failed start's processes (the GCS, the dashboard, the agents) would stay
behind with their ports and memory: they are this process's new descendants, ended first.
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


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, theirs, ...), from /proc; empty without it."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
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
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
