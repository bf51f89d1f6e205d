"""CPU time of a process tree, read from Linux's /proc: what a local server (Ray, Serve, the
replicas) spends, counted from the benchmark process that started it.

    tree = tree_cpu_seconds(os.getpid(), include_root=False)   # before
    ...                                                        # the load
    cpu_used(tree, tree_cpu_seconds(os.getpid(), include_root=False))
"""

from __future__ import annotations

import os


def _stat(pid: int | str) -> tuple[int, float]:
    """(parent's pid, user + system CPU seconds) of a process; OSError once it is gone."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name is in parentheses and may hold spaces or ")": the fields start after
    # its last ")". fields[1] is the parent's pid, fields[11:13] utime and stime in ticks.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (10 ms ticks on Linux)."""
    return _stat(pid)[1]


def tree_cpu_seconds(root: int, *, include_root: bool = True) -> dict[int, float]:
    """{pid: user + system CPU seconds} of every process descended from `root`, and of `root`
    itself unless `include_root` is False (a load generator running in it is no server's)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent, seconds = _stat(entry)
        except OSError:  # gone meanwhile
            continue
        pid = int(entry)
        parents[pid] = parent
        times[pid] = seconds
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree: dict[int, float] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in times and (include_root or pid != root):
            tree[pid] = times[pid]
        stack.extend(children.get(pid, ()))
    return tree


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the tree spent between two readings, counted per pid (`cpu_used_by_pid`)."""
    return sum(cpu_used_by_pid(before, after).values())


def cpu_used_by_pid(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    """{pid: CPU seconds it spent between two readings}.

    A process new since `before` counts from 0 (all its time is in the interval). One gone by
    `after` is lost: what it spent since `before` is no longer in /proc (it went to its parent's
    cutime, which only a waiting parent collects), so short-lived processes are undercounted.
    A pid whose time went down is a reused pid, a new process: it counts from 0 too."""
    used = {}
    for pid, seconds in after.items():
        earlier = before.get(pid, 0.0)
        used[pid] = seconds - earlier if seconds >= earlier else seconds
    return used


def process_role(pid: int) -> str:
    """What a process is, by its command line: Ray names its workers after what they run
    ("ray::ServeReplica:app:GroupServer" gives "GroupServer", "ray::ProxyActor"), other
    processes by their program ("raylet", "gcs_server"); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return ""
    first = argv[0].decode(errors="replace") if argv else ""
    if first.startswith("ray::"):
        return first[len("ray::"):].split(":")[-1].split(".")[0] or first
    program = os.path.basename(first.split()[0]) if first.strip() else ""
    args = [a.decode(errors="replace") for a in argv[1:] if a]
    if program.startswith("python") and args:  # a Python program: its script or module
        if args[0] == "-m" and len(args) > 1:
            return args[1]
        return program if args[0].startswith("-") else os.path.basename(args[0])
    return program


def cpu_by_role(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """`cpu_used` split by `process_role`, most first."""
    by_role: dict[str, float] = {}
    for pid, used in cpu_used_by_pid(before, after).items():
        role = process_role(pid) or "other"
        by_role[role] = by_role.get(role, 0.0) + used
    return dict(sorted(by_role.items(), key=lambda kv: -kv[1]))
