"""BodyBudget: the request-body bytes one ingress replica holds at once.

A body is read whole before admission can price it (admission charges its prompts x n), so
`max_request_body_bytes` bounds one body but not thousands arriving together: 4,096 ongoing
requests of 8 MiB would be 32 GiB on one replica. Each body's bytes count against this
budget from the first byte read (all of a declared Content-Length at once) until the body
is parsed; a body that would pass it gets 429 with Retry-After before more of it is read.
Everything here runs on the ingress's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tandem.router.errors import overloaded


class BodyBudget:
    def __init__(self, max_bytes: int, retry_after_s: int = 1) -> None:
        self.max_bytes = max_bytes
        self.retry_after_s = retry_after_s
        self.held = 0  # bytes of the bodies being read or parsed now
        self.num_refused = 0

    @contextmanager
    def hold(self) -> Iterator[Callable[[int], None]]:
        """A body's reservation: call it with each count of bytes about to be read (429 once
        the replica's bodies would hold more than `max_bytes`); all of it is given back at exit."""
        taken = 0

        def take(num_bytes: int) -> None:
            nonlocal taken
            if self.held + num_bytes > self.max_bytes:
                self.num_refused += 1
                raise overloaded(f"the request bodies this server is reading hold {self.held} of its "
                                 f"{self.max_bytes} bytes", self.retry_after_s)
            self.held += num_bytes
            taken += num_bytes

        try:
            yield take
        finally:
            self.held -= taken
