"""Chosen ports come from below the kernel's ephemeral range, where no process binding port 0
(Ray starts dozens) can take one between the choice and its bind."""

from __future__ import annotations

import socket

from tandem.cluster import net


def test_a_chosen_port_is_free_and_outside_the_ephemeral_range() -> None:
    low, high = net.PORT_RANGE
    ports = {net.free_port() for _ in range(20)}
    assert all(low <= p < high for p in ports)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert high <= ephemeral_low
    port = ports.pop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # free indeed


def test_a_taken_range_falls_back_to_any_free_port(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(net, "PORT_RANGE", (port, port + 1))  # its one port is taken
        chosen = net.free_port()
        assert chosen != port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", chosen))


def test_ports_chosen_one_after_another_before_any_is_bound_are_all_different(monkeypatch) -> None:
    # A server's HTTP, gRPC and metrics ports are chosen together and bound later: two equal ones
    # would fail the second bind (a proxy's gRPC port taken by the metrics agent).
    monkeypatch.setattr(net, "PORT_RANGE", (24000, 24040))
    monkeypatch.setattr(net, "_handed_out", set())
    ports = [net.free_port() for _ in range(30)]
    assert len(set(ports)) == 30
