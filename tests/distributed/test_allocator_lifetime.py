"""The detached KV allocator actor ends itself once no group has used it for idle_exit_s
(an application stopped without `tandem serve`'s teardown leaves nothing behind), and
stays while a group is registered."""

from __future__ import annotations

import time

import pytest

from tandem.cluster.kv_allocator import allocator_name, get_or_create_allocator, kill_allocator
from tests.conftest import wait_for


def _exists(app: str) -> bool:
    import ray

    try:
        ray.get_actor(allocator_name(app), namespace="tandem")
    except ValueError:
        return False
    return True


def _wait_gone(app: str, timeout_s: float) -> bool:
    return wait_for(lambda: not _exists(app), timeout_s=timeout_s, interval_s=0.2)


def test_an_allocator_without_groups_ends_itself(ray_local) -> None:
    import ray

    actor = get_or_create_allocator("idle-app", idle_exit_s=1.0)
    assert ray.get(actor.ping.remote()) > 0
    assert _wait_gone("idle-app", timeout_s=20.0)
    # A later application's group simply creates a new one.
    again = get_or_create_allocator("idle-app", idle_exit_s=1.0)
    assert ray.get(again.ping.remote()) > 0
    kill_allocator("idle-app")


def test_an_allocator_with_a_group_stays(ray_local) -> None:
    import ray

    actor = get_or_create_allocator("busy-app", idle_exit_s=1.0)
    ray.get(actor.register.remote("g", "m", 16, 10, "n"))
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # keeps publishing, as a group's client does
        assert ray.get(actor.publish.remote("g", [], {}))
        time.sleep(0.2)
    assert _exists("busy-app")
    ray.get(actor.unregister.remote("g"))
    assert _wait_gone("busy-app", timeout_s=20.0)


@pytest.fixture(autouse=True)
def _no_leftovers(ray_local):
    yield
    for app in ("idle-app", "busy-app"):
        kill_allocator(app)
