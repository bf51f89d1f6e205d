"""The replica groups each deployment's request router in this process knows now.

The router (request_router.py) runs in each caller's process, on Serve's router thread, and
publishes its groups here whenever Serve updates them; the ingress reads them on its event
loop (router/engine_client.py: while a deployment has one group, streamed requests go on
the ingress's channel to it). Each value is replaced whole, never changed in place.

Serve may rebuild the router's class by value (cloudpickle) rather than import its module,
so the router reaches this module with an import when it publishes, never through a
global of its own module.
"""

from __future__ import annotations

_KNOWN: dict[tuple[str, str], frozenset[str]] = {}  # (application, deployment) -> replica ids


def publish(app_name: str, deployment_name: str, groups: frozenset[str]) -> None:
    _KNOWN[(app_name, deployment_name)] = groups


def known_groups(app_name: str, deployment_name: str) -> frozenset[str]:
    """The groups this process's router for that deployment knows now (none before its first
    update: no router has run here yet)."""
    return _KNOWN.get((app_name, deployment_name), frozenset())
