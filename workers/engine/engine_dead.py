"""EngineDeadError, in a module of its own: what only catches it (the group's Serve deployment,
which the application's builder imports) imports neither the engine nor torch."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The group failed (a worker died or raised); it must be rebuilt."""
