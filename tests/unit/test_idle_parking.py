"""IdleParking's clock and hand-offs, with a fake group (a list of what was called)."""

from __future__ import annotations

import time

import pytest

from tandem.workers.executor.parking import IdleParking


class FakeGroup:
    def __init__(self, fail_unpark: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_unpark = fail_unpark

    def park(self) -> str:
        self.calls.append("park")
        return f"park-{self.calls.count('park')}"

    def unpark(self, handle: str, timeout_s: float) -> None:
        self.calls.append(f"unpark {handle} {timeout_s:g}")
        if self.fail_unpark:
            raise RuntimeError("worker 1 died")


def _wait_parked(parking: IdleParking, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not parking.parked:
        assert time.monotonic() < deadline, "the workers were never parked"
        time.sleep(0.01)


def test_parks_after_idle_and_unparks_before_the_next_step() -> None:
    group = FakeGroup()
    parking = IdleParking(0.05, group.park, group.unpark, unpark_timeout_s=7.0)
    _wait_parked(parking)
    assert group.calls == ["park"] and parking.num_parks == 1
    parking.step_started()
    assert group.calls == ["park", "unpark park-1 7"] and not parking.parked
    parking.step_done()
    _wait_parked(parking)  # idle again: parked again, once
    time.sleep(0.15)
    assert group.calls == ["park", "unpark park-1 7", "park"] and parking.num_parks == 2
    parking.close()
    assert group.calls[-1] == "unpark park-2 7"  # a teardown finds the workers in their loops


def test_never_parks_while_a_step_is_in_flight() -> None:
    group = FakeGroup()
    parking = IdleParking(0.05, group.park, group.unpark, unpark_timeout_s=1.0)
    parking.step_started()
    parking.step_started()  # two in flight (a step scheduled ahead of the last one's result)
    parking.step_done()
    time.sleep(0.2)
    assert group.calls == [] and not parking.parked
    parking.step_done()
    _wait_parked(parking)
    parking.close(unpark=False)  # a failed group's workers are killed, not woken
    assert group.calls == ["park"]


def test_an_unpark_that_fails_fails_the_step_and_the_clock_stays_balanced() -> None:
    group = FakeGroup(fail_unpark=True)
    parking = IdleParking(0.05, group.park, group.unpark, unpark_timeout_s=1.0)
    _wait_parked(parking)
    with pytest.raises(RuntimeError, match="worker 1 died"):
        parking.step_started()
    parking.step_done()  # what the executor's `finally` does
    assert not parking.parked
    parking.close(unpark=False)  # the executor fails the group
    assert group.calls == ["park", "unpark park-1 1"]


def test_a_step_right_after_start_up_never_waits_for_a_park() -> None:
    group = FakeGroup()
    parking = IdleParking(60.0, group.park, group.unpark, unpark_timeout_s=1.0)
    parking.step_started()
    parking.step_done()
    parking.close()
    assert group.calls == []


def test_park_after_must_be_positive() -> None:
    group = FakeGroup()
    with pytest.raises(ValueError, match="park_workers_after_s: must be > 0"):
        IdleParking(0.0, group.park, group.unpark, unpark_timeout_s=1.0)
