"""The detached KV allocator actor ends itself once no group has used it for idle_exit_s
(an application stopped without `tandem serve`'s teardown leaves nothing behind), and
stays while a group is registered."""

from __future__ import annotations

import time

import pytest

from tandem.cluster.kv_allocator import allocator_name, get_or_create_allocator, kill_allocator
from tests.conftest import wait_for

pytestmark = pytest.mark.slow  # Ray workers or a simulated cluster: not in the fast loop


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

    # The idle clock runs from the actor's start until the group registers, so idle_exit_s
    # outlasts the register call's way to a new actor on a loaded host (over 1 s in a suite).
    actor = get_or_create_allocator("busy-app", idle_exit_s=5.0)
    ray.get(actor.register.remote("g", "m", 16, 10, "n"))
    # Publishes, then stays silent past idle_exit_s (a loaded host delays a group's publishes):
    # a registered group counts as alive until its group timeout (10 s).
    assert ray.get(actor.publish.remote("g", [], {}))
    time.sleep(6.0)
    assert _exists("busy-app")
    assert ray.get(actor.publish.remote("g", [], {}))
    ray.get(actor.unregister.remote("g"))
    assert _wait_gone("busy-app", timeout_s=20.0)


def test_an_allocator_made_by_a_group_outlives_the_groups_placement_group(ray_local) -> None:
    """A group's replica runs in a placement group that captures its child actors (Serve's
    way); the allocator it creates must not land there, or it dies with that group and,
    its bundle gone, never restarts: every group built later would stay unregistered."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Replica:
        def make_allocator(self) -> float:
            return ray.get(get_or_create_allocator("pg-app").ping.remote())

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_capture_child_tasks=True)).remote()
    started = ray.get(replica.make_allocator.remote())
    ray.kill(replica)
    remove_placement_group(pg)
    actor = ray.get_actor(allocator_name("pg-app"), namespace="tandem")
    assert ray.get(actor.ping.remote(), timeout=10) == started  # the same one, never restarted
    # Killed (a fault), it restarts and answers again.
    ray.kill(actor, no_restart=False)
    assert wait_for(lambda: _answers("pg-app"), timeout_s=30.0, interval_s=0.5)


def _answers(app: str) -> bool:
    import ray

    try:
        ray.get(ray.get_actor(allocator_name(app), namespace="tandem").ping.remote(), timeout=2)
    except Exception:  # noqa: BLE001 - restarting
        return False
    return True


@pytest.fixture(autouse=True)
def _no_leftovers(ray_local):
    yield
    for app in ("idle-app", "busy-app", "pg-app"):
        kill_allocator(app)
