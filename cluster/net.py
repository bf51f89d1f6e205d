"""Ports chosen at run time: nothing in tandem binds a fixed port it did not ask for."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ("" = every interface). Whoever binds it next
    may race another process for it; callers that can retry do."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
