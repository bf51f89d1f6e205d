"""A local Ray whose start timed out (its raylet gave up on a slow dashboard agent) is started
once more, after what the first try started is ended."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tandem.cluster import local_ray
from tandem.cluster.local_ray import descendants, running, start_local_ray

TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                      "failed to startup or the GCS has become overloaded.")


class FakeRay:
    """ray.init / ray.shutdown: the first `failures` starts leave a process tree behind (a
    child, like the GCS, and its own child, like a dashboard module) and raise `error`."""

    def __init__(self, error: Exception, failures: int = 1) -> None:
        self.error, self.failures = error, failures
        self.calls: list[dict] = []
        self.left: list[int] = []
        self.shutdowns = 0

    def init(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            # sh, a child of this process, waits on a sleep of its own: a tree two deep.
            tree = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            self.left += [tree.pid, int(tree.stdout.readline())]
            raise self.error

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    def install(error: Exception = TIMED_OUT, failures: int = 1) -> FakeRay:
        import ray

        fake = FakeRay(error, failures)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(local_ray, "END_WAIT_S", 2.0)
        return fake
    return install


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_start_that_timed_out_is_made_again_after_its_processes_end(fake_ray, caplog):
    fake = fake_ray()
    with caplog.at_level(logging.WARNING, logger="tandem.cluster.local_ray"):
        start_local_ray(address="local", num_cpus=3)
    assert fake.calls == [{"address": "local", "num_cpus": 3}] * 2
    assert fake.shutdowns == 1
    assert len(fake.left) == 2 and not any(running(pid) for pid in fake.left)
    assert "Ray's start timed out (The current node timed out during startup); ending what it started and " \
           "starting it once more" in caplog.text


def test_any_other_error_is_raised_at_once(fake_ray):
    fake = fake_ray(ValueError("num_cpus must be >= 0"))
    with pytest.raises(ValueError, match="num_cpus must be >= 0"):
        start_local_ray(num_cpus=-1)
    assert len(fake.calls) == 1
    for pid in fake.left:
        subprocess.run(["kill", str(pid)], check=False)


def test_a_second_timeout_is_raised(fake_ray):
    fake = fake_ray(failures=2)
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray()
    assert len(fake.calls) == 2
    assert not any(running(pid) for pid in fake.left[:2])  # the first try's
    for pid in fake.left[2:]:
        subprocess.run(["kill", str(pid)], check=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_descendants_are_children_and_theirs_only():
    tree = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(tree.stdout.readline())
    try:
        assert {tree.pid, grandchild} <= descendants(local_ray.os.getpid())
        assert descendants(tree.pid) == {grandchild}
        assert descendants(grandchild) == set()
    finally:
        local_ray.end_processes({tree.pid, grandchild})
    assert not running(tree.pid) and not running(grandchild)


class _Info:
    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_stopping_ends_what_the_rays_processes_left_running(monkeypatch):
    """As Serve's HAProxy outlived its proxy actor and its Ray: what ray.shutdown() leaves of
    the Ray's process tree is ended; a process of ours outside that tree is not."""
    import ray
    from ray._private import worker

    raylet = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    haproxy = int(raylet.stdout.readline())
    ours = subprocess.Popen(["sleep", "600"])
    node = type("Node", (), {"all_processes": {"raylet": [_Info(raylet)]}})()
    monkeypatch.setattr(worker, "_global_node", node, raising=False)

    def shutdown() -> None:  # Ray's: its own processes end, their children stay
        raylet.kill()
        raylet.wait()
        monkeypatch.setattr(worker, "_global_node", None)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    try:
        local_ray.stop_local_ray()
        assert not running(haproxy)
        assert running(ours.pid)
    finally:
        ours.kill()
        ours.wait()


def test_stopping_a_ray_this_process_only_joined_ends_nothing(monkeypatch):
    import ray
    from ray._private import worker

    monkeypatch.setattr(worker, "_global_node", type("Node", (), {"all_processes": {}})(), raising=False)
    ends = []
    monkeypatch.setattr(local_ray, "end_processes", ends.append)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    local_ray.stop_local_ray()
    assert ends == [set()]
