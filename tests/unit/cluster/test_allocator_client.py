"""AllocatorClient: what each interval publishes, an idle group's heartbeat, re-registration."""

from __future__ import annotations

from unittest import mock

import pytest

from tandem.cluster.allocator_client import AllocatorClient, GroupIdentity


class _Method:
    def __init__(self, calls: list, name: str, answer) -> None:
        self.calls, self.name, self.answer = calls, name, answer

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args))
        return self.answer() if callable(self.answer) else self.answer


class FakeAllocator:
    """The allocator actor's methods; each `.remote` answers at once (ray.get is patched to
    hand the answer back)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.knows = True
        self.publish = _Method(self.calls, "publish", lambda: self.knows)
        self.register = _Method(self.calls, "register", {"started_at": 0.0, "host_bytes": 0})
        self.unregister = _Method(self.calls, "unregister", None)

    def published(self) -> list[tuple]:
        return [args for name, args in self.calls if name == "publish"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def client():
    actor, clock = FakeAllocator(), Clock()
    identity = GroupIdentity("g1", "m", block_size=16, device_blocks=64, node_id="n1")
    # An interval that never passes: the test ticks by hand.
    made = AllocatorClient(lambda: actor, identity, interval_s=1e6, heartbeat_s=1.0, clock=clock)
    with mock.patch("ray.get", lambda answer, timeout=None: answer):
        yield made, actor, clock
        made.close()


def usage(running: int) -> dict:
    return {"num_running": running, "num_waiting": 0, "kv_usage": running / 64}


def test_an_idle_group_publishes_once_a_heartbeat(client) -> None:
    made, actor, clock = client
    made._tick()
    assert actor.calls == []  # nothing submitted yet: nothing to say
    made.submit([], usage(0), snapshot=lambda: [11, 12])  # the first submit registers with all it holds
    made._tick()
    assert [name for name, _ in actor.calls] == ["register", "publish"] and made.num_registrations == 1
    for _ in range(7):  # idle: the same usage, no events, for 7/8 s (binary-exact steps)
        clock.now += 0.125
        made.submit([], usage(0), snapshot=lambda: [])
        made._tick()
    assert len(actor.published()) == 1
    clock.now += 0.125  # a second since the last publish: the heartbeat
    made._tick()
    assert len(actor.published()) == 2 and actor.published()[-1] == ("g1", [], usage(0))


def test_events_or_new_usage_go_out_at_the_next_interval(client) -> None:
    made, actor, clock = client
    made.submit([], usage(0), snapshot=lambda: [])
    made._tick()
    clock.now += 0.1
    made.submit([("stored", 5)], usage(0), snapshot=lambda: [])
    made._tick()
    clock.now += 0.1
    made.submit([], usage(3), snapshot=lambda: [])  # a request came: the router's load changes
    made._tick()
    assert actor.published()[1:] == [("g1", [("stored", 5)], usage(0)), ("g1", [], usage(3))]


def test_an_allocator_that_forgot_the_group_gets_a_snapshot(client) -> None:
    made, actor, clock = client
    made.submit([], usage(0), snapshot=lambda: [])
    made._tick()
    actor.knows = False  # it restarted, empty
    clock.now += 1.0
    made._tick()
    assert made.want_snapshot
    actor.knows = True
    made.submit([("stored", 9)], usage(0), snapshot=lambda: [7, 8, 9])  # the snapshot replaces the events
    made._tick()
    assert actor.calls[-2:] == [("register", ("g1", "m", 16, 64, "n1", [7, 8, 9])), ("publish", ("g1", [], usage(0)))]
    assert made.num_registrations == 2
