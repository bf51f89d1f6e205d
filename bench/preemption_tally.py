"""PreemptionTally: the preemptions of every engine a soak's server ran, from its KV reports.

A group reports its engine's count (`num_preemptions`), which starts again when the engine is
rebuilt in place (its `num_rebuilds` goes up) or when the group's replica is replaced (a new
group id). So each engine's life, known by (group id, rebuilds), keeps the highest count read
of it, and the tally is their sum. The reads are the reports the soak makes anyway (before
each fault, while recovering, while draining): preemptions of an engine after its last read,
before it died, are not counted, so the tally is a lower bound.
"""

from __future__ import annotations

from typing import Any


class PreemptionTally:
    def __init__(self) -> None:
        self._lives: dict[tuple[str, int], int] = {}  # (group id, rebuilds) -> highest count read

    def read(self, report: dict[str, Any]) -> None:
        """Note the counts of a KV report (kv_report.py's shape)."""
        for group_id, group in report.get("groups", {}).items():
            life = (group_id, group.get("num_rebuilds", 0))
            self._lives[life] = max(self._lives.get(life, 0), group.get("num_preemptions", 0))

    @property
    def total(self) -> int:
        return sum(self._lives.values())
