from __future__ import annotations

import pytest

from tandem.cluster.kv_allocator import KVAllocatorState


def test_register_publish_match_and_usage() -> None:
    a = KVAllocatorState(host_bytes_per_node=1000)
    a.register("g1", "m", 16, 100, "node-a")
    a.register("g2", "m", 16, 50, "node-a", cached_hashes=[11, 12])
    assert a.publish("g1", [("stored", 11), ("stored", 12), ("stored", 13)], {"num_running": 2})
    assert a.match([11, 12, 13, 14]) == {"g1": 3, "g2": 2}
    assert a.match([11, 12], model_id="other") == {}
    usage = a.usage()
    assert usage["g1"]["num_running"] == 2 and usage["g1"]["directory_blocks"] == 3
    assert a.capacity()["device_blocks"] == 150


def test_host_budget_is_shared_per_node() -> None:
    a = KVAllocatorState(host_bytes_per_node=1000)
    a.register("g1", "m", 16, 10, "node-a")
    a.register("g2", "m", 16, 10, "node-a")
    a.register("g3", "m", 16, 10, "node-b")
    assert a.lease_host("g1", 700) == 700
    assert a.lease_host("g2", 700) == 300  # what node-a has left
    assert a.lease_host("g3", 700) == 700
    assert a.capacity()["host_bytes_leased"] == 1700


def test_unknown_group_is_told_to_register_again_and_death_clears_its_blocks() -> None:
    a = KVAllocatorState()
    assert a.publish("ghost", [("stored", 1)], {}) is False  # e.g. after an allocator restart
    a.register("g1", "m", 16, 10, "n", cached_hashes=[1, 2])
    a.unregister("g1")
    assert a.match([1, 2]) == {}
    with pytest.raises(ValueError, match="device_blocks"):
        a.register("g2", "m", 16, 0, "n")


def test_a_group_silent_past_the_timeout_is_dropped_with_its_leases() -> None:
    now = [0.0]
    a = KVAllocatorState(host_bytes_per_node=1000, group_timeout_s=10.0, clock=lambda: now[0])
    a.register("alive", "m", 16, 10, "n", cached_hashes=[1])
    a.register("killed", "m", 16, 10, "n", cached_hashes=[1, 2], host_bytes=800)
    assert a.lease_host("alive", 800) == 200
    now[0] = 6.0
    assert a.publish("alive", [], {"num_running": 0})
    now[0] = 12.0  # "killed" last spoke at 0 (registration), "alive" at 6
    assert a.match([1, 2]) == {"alive": 1}
    assert set(a.usage()) == {"alive"}
    assert a.lease_host("alive", 800) == 800  # the dead group's host bytes went back to the node
    assert a.publish("killed", [], {}) is False  # had it only been slow: it registers again


def test_idle_only_after_no_live_group_has_spoken_for_idle_exit_s() -> None:
    now = [0.0]
    a = KVAllocatorState(group_timeout_s=10.0, clock=lambda: now[0], idle_exit_s=600.0)
    now[0] = 599.0
    assert not a.is_idle()  # a fresh allocator waits for its first group as long
    now[0] = 600.0
    assert a.is_idle()
    a.register("g", "m", 16, 10, "n")
    now[0] = 5000.0
    assert a.publish("g", [], {}) and not a.is_idle()
    now[0] = 5609.0  # a publish late by more than idle_exit_s: the group is still alive
    assert not a.is_idle()
    now[0] = 5000.0
    a.unregister("g")
    now[0] = 5599.0
    assert not a.is_idle()
    now[0] = 5600.0
    assert a.is_idle()
    a.register("killed", "m", 16, 10, "n")  # never speaks again (its process was killed)
    now[0] = 6209.0
    assert not a.is_idle()  # a registered group counts as alive until its group timeout
    now[0] = 6210.0
    assert a.is_idle()
    assert not KVAllocatorState(clock=lambda: now[0]).is_idle()  # idle_exit_s None: never
