"""Naming a failed Ray worker: which rank of the group (when Ray's error says) and why, in one line.

RayExecutor raises it as its GroupFailedError, and the engine ends the group's requests with it.
"""

from __future__ import annotations

import re
from typing import Any


def describe_failure(exc: BaseException, workers: list[Any], worker_info: list[dict[str, Any]], tp: int) -> str:
    """One line naming the worker that failed (when Ray says which) and why."""
    actor_id = getattr(exc, "actor_id", None)  # RayActorError: the dead actor
    found = re.search(r"\(pid=(\d+),", str(exc))  # RayTaskError: "ray::Worker() (pid=..., ip=...)"
    pid = int(found.group(1)) if found else None
    where = "a worker"
    for rank, w in enumerate(workers):
        info = worker_info[rank] if rank < len(worker_info) else {}
        if (actor_id is not None and w._actor_id.hex() == actor_id) or (pid is not None and info.get("pid") == pid):
            where = f"worker {rank_name(rank, tp)}"
    cause = getattr(exc, "cause", None)
    kind = type(cause if isinstance(cause, BaseException) else exc).__name__
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else kind
    verb = "died" if actor_id is not None else "failed"
    return f"{where} {verb}: {last if last.startswith(kind) else f'{kind}: {last}'}"


def rank_name(rank: int, tp: int) -> str:
    """A worker's place in the group: its pipeline stage and its tensor-parallel rank there."""
    return f"pp_rank={rank // tp} tp_rank={rank % tp}"
