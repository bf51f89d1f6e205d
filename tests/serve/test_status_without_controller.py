"""The ingress's view of the groups' status when Serve's controller does not answer, as while
Ray's GCS is down (a head-node failure): requests and /health go on with the last known answer
after waiting `_STATUS_WAIT_S` at most, one status read stays in flight, and its answer lands
once the controller is back. (tests/deploy/test_gcs_fault_tolerance.py kills a real GCS.)"""

from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

from tandem.router import engine_client
from tandem.router.engine_client import EngineClient

WAIT_S = 0.3  # _STATUS_WAIT_S here


class StuckController:
    """serve.status() as seen while the GCS is down: it blocks until `answer` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.released = threading.Event()
        self.answer = (True, True)

    def read(self) -> tuple[bool, bool]:  # patched in as a bound method: no EngineClient argument
        self.calls += 1
        self.released.wait(timeout=30)
        return self.answer


def client() -> EngineClient:
    tokenizer = mock.Mock(get_vocab=mock.Mock(return_value={"a": 0}))
    return EngineClient(mock.Mock(), tokenizer=tokenizer, model_name="m", max_model_len=16, vocab_size=1,
                        channels=False)


async def timed(awaitable) -> tuple[object, float]:
    started = time.monotonic()
    result = await awaitable
    return result, time.monotonic() - started


def test_a_stuck_controller_holds_neither_requests_nor_health() -> None:
    controller = StuckController()

    async def run() -> None:
        ec = client()
        # The last answer ("every group up") is older than _HEALTH_MAX_AGE TTLs: a request waits
        # for a fresh one, but not past WAIT_S; the next caller does not wait at all.
        ec._status = (time.monotonic() - 11 * engine_client._HEALTH_TTL_S, True, True)
        first, first_s = await timed(ec._can_serve_now())
        second, second_s = await timed(ec._can_serve_now())
        health, health_s = await timed(ec.health())
        assert (first, second, health["ready"], health["all_healthy"]) == (True, True, True, True)
        assert WAIT_S <= first_s < WAIT_S + 1.0 and second_s < 0.1 and health_s < 0.1, (first_s, second_s, health_s)
        assert controller.calls == 1  # one read in flight, not one per request

        # The controller answers again (one group of two down): that answer lands.
        controller.answer = (False, True)
        controller.released.set()
        await asyncio.wait_for(asyncio.shield(ec._refresh), 5)
        assert (await ec.health())["all_healthy"] is False and controller.calls == 1

    with mock.patch.object(engine_client, "_STATUS_WAIT_S", WAIT_S), \
            mock.patch.object(EngineClient, "_read_group_status", controller.read):
        asyncio.run(run())


def test_a_stale_no_is_a_quick_no_while_the_controller_is_stuck() -> None:
    controller = StuckController()

    async def run() -> None:
        ec = client()
        ec._status = (time.monotonic() - 2 * engine_client._HEALTH_TTL_S, False, False)
        answer, waited_s = await timed(ec._can_serve_now())
        assert answer is False and WAIT_S <= waited_s < WAIT_S + 1.0, waited_s  # a 503 now, not a hang
        controller.released.set()

    with mock.patch.object(engine_client, "_STATUS_WAIT_S", WAIT_S), \
            mock.patch.object(EngineClient, "_read_group_status", controller.read):
        asyncio.run(run())


def test_a_group_the_router_knows_answers_without_asking_the_controller() -> None:
    from tandem.router import known_groups

    controller = StuckController()

    async def run() -> None:
        ec = client()
        ec._status = (time.monotonic() - 11 * engine_client._HEALTH_TTL_S, False, False)  # old, and a "no"
        known_groups.publish(ec._app_name, ec._deployment_name, frozenset({"g1", "g2"}))
        try:
            (answer, waited_s), (up, _) = await timed(ec._can_serve_now()), await timed(ec.groups_up())
            assert (answer, up, controller.calls) == (True, 2, 0) and waited_s < 0.1
            # The router's last group goes: the controller is asked again (and, stuck, the
            # old "no" stands once the wait is over).
            known_groups.publish(ec._app_name, ec._deployment_name, frozenset())
            answer, waited_s = await timed(ec._can_serve_now())
            assert (answer, controller.calls) == (False, 1) and WAIT_S <= waited_s < WAIT_S + 1.0
        finally:
            known_groups._KNOWN.pop((ec._app_name, ec._deployment_name), None)
            controller.released.set()

    with mock.patch.object(engine_client, "_STATUS_WAIT_S", WAIT_S), \
            mock.patch.object(EngineClient, "_read_group_status", controller.read):
        asyncio.run(run())
