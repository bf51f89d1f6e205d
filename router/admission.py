"""Admission: shed what the replica groups cannot take, at the door, before any work.

The ingress counts the group requests it has in flight (sent or about to be, and not
finished), per application and per group (a request counts for its group once the
router has placed it). A new request is admitted only while

    in_flight + cost <= max_requests_per_group * groups_up      (a bounded queue per group)
    in_flight + cost <= max_requests                            (a bounded queue per application)

where `cost` is the number of sequences it becomes (prompts x n: each sample is a sequence
in the engine, which bounds sequences, not requests).
Beyond either bound it is refused at once with `Overloaded` (HTTP 429 / gRPC
RESOURCE_EXHAUSTED); with no group up, `NoGroupUp` (503 / UNAVAILABLE). Both carry a
Retry-After. The check runs before the prompt is tokenized, so an overloaded server
spends next to nothing on the requests it sheds: under a load far above capacity the
admitted ones still finish in time instead of every request waiting in a queue until
it times out.

The bounds are per ingress replica (build_app divides the application's by the number
of ingress replicas). Serve's own `max_queued_requests` stays behind this as a backstop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tandem.router.engine_client import ServiceUnavailable


@dataclass(frozen=True)
class AdmissionLimits:
    max_requests_per_group: int  # group requests in flight per group that is up (running + queued)
    max_requests: int | None = None  # for the whole application (this ingress replica's share); None: no cap
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_requests_per_group < 1:
            raise ValueError(f"max_requests_per_group: must be >= 1, got {self.max_requests_per_group}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests: must be >= 1 (or None), got {self.max_requests}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s: must be >= 0, got {self.retry_after_s}")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> AdmissionLimits:
        return cls(**{k: options[k] for k in ("max_requests_per_group", "max_requests", "retry_after_s")
                      if k in options})


class _ComeBackLater(Exception):
    """A refusal the client may retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s)  # both in args: pickle re-creates it from them
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message


class Overloaded(_ComeBackLater):
    """The groups that are up hold as many requests as they may: come back later."""


class NoGroupUp(_ComeBackLater, ServiceUnavailable):
    """No replica group is up: 503 / UNAVAILABLE, come back after `retry_after_s`."""


class Ticket:
    """One admitted request's place; `release` (idempotent) gives it back."""

    def __init__(self, admission: Admission, cost: int) -> None:
        self._admission = admission
        self.cost = cost
        self.group_ids: list[str] = []
        self.released = False

    def assign(self, group_ids: list[str]) -> None:
        """The groups the router placed the request's group requests on."""
        self._admission.by_group.update(group_ids)
        self.group_ids = list(group_ids)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission.in_flight -= self.cost
        self._admission.by_group.subtract(self.group_ids)
        self._admission.by_group += Counter()  # drop groups at zero


class Admission:
    def __init__(self, limits: AdmissionLimits, groups_up: Callable[[], Awaitable[int]]) -> None:
        self.limits = limits
        self._groups_up = groups_up
        self.in_flight = 0  # group requests admitted and not yet finished
        self.by_group: Counter[str] = Counter()  # of those, the ones placed on each group
        self.num_admitted = 0
        self.num_shed = 0

    async def admit(self, cost: int = 1, one_group: int = 1) -> Ticket:
        """A ticket for `cost` sequences, of which `one_group` (a prompt's n samples) must run
        on one group; Overloaded / NoGroupUp at once, or ValueError (naming n) for a request
        no state of the service could ever admit, rather than a 429 it would retry forever."""
        limits = self.limits
        if one_group > limits.max_requests_per_group:
            raise ValueError(f"n: {one_group} samples of one prompt are more than one replica group admits "
                             f"({limits.max_requests_per_group} sequences)")
        if limits.max_requests is not None and cost > limits.max_requests:
            raise ValueError(f"n: the request's {cost} sequences are more than this server admits at once "
                             f"({limits.max_requests})")
        groups_up = await self._groups_up()
        if groups_up <= 0:
            self.num_shed += 1
            raise NoGroupUp("no replica group is running", limits.retry_after_s)
        bound = limits.max_requests_per_group * groups_up
        if limits.max_requests is not None:
            bound = min(bound, limits.max_requests)
        # No await between the check and the count: on one event loop, this is atomic.
        if self.in_flight + cost > bound:
            self.num_shed += 1
            raise Overloaded(f"{self.in_flight} requests in flight, at most {bound} for {groups_up} "
                             f"replica group(s)", limits.retry_after_s)
        self.in_flight += cost
        self.num_admitted += 1
        return Ticket(self, cost)

    def stats(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "by_group": dict(self.by_group), "num_admitted": self.num_admitted,
                "num_shed": self.num_shed}


@asynccontextmanager
async def admitted(admission: Admission | None, cost: int = 1, one_group: int = 1) -> AsyncIterator[Ticket | None]:
    """Hold a ticket for the block's duration (no admission control: None)."""
    if admission is None:
        yield None
        return
    ticket = await admission.admit(cost, one_group)
    try:
        yield ticket
    finally:
        ticket.release()


class ReleasingStream:
    """An SSE body that gives its ticket back when it ends, fails, is closed, or is dropped
    unstarted (a client gone before the first byte: Starlette never iterates it then)."""

    def __init__(self, chunks: AsyncIterator[str], ticket: Ticket) -> None:
        self._chunks = chunks
        self._ticket = ticket

    def __aiter__(self) -> ReleasingStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await anext(self._chunks)
        except BaseException:
            self._ticket.release()
            raise

    async def aclose(self) -> None:
        self._ticket.release()
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    def __del__(self) -> None:
        self._ticket.release()

