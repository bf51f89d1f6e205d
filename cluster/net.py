"""Ports chosen at run time: nothing in tandem binds a fixed port it did not ask for."""

from __future__ import annotations

import random
import socket

# Where a chosen port is drawn from: below the kernel's ephemeral range (Linux: 32768-60999),
# where every process binding port 0 gets its port (Ray's GCS, raylets, agents and workers'
# servers start dozens), above Ray's worker ports (10002-19999), and below the ports Serve gives
# its replicas' direct ingress (30000 up). A port drawn from the ephemeral range could be taken
# by any process started between the choice and the bind (a test's ray.init did so).
PORT_RANGE = (20000, 30000)
_TRIES = 64
# Every port this process has handed out: several chosen one after another, before any is bound
# (a server's HTTP, gRPC and metrics ports), are never the same one.
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ("" = every interface), from PORT_RANGE when one
    there is free. Whoever binds it next may still race another chooser for it; callers that
    can retry do."""
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        port = rng.randrange(*PORT_RANGE)
        if port not in _handed_out and bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is full: any port
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def bindable(host: str, port: int) -> bool:
    """Whether a socket could bind `port` on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
