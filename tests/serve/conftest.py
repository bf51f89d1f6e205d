"""Serve test helpers: one application per test module on the shared Serve (tests/shared_ray.py), with tiny models."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tandem.cluster.net import free_port  # noqa: F401 - the serve tests import it from here
from tests.conftest import wait_for

APP_NAME = "tandem"


@contextmanager
def serve_app(args: dict[str, Any]) -> Iterator[str]:
    """An application of build_app(args) on the shared Serve (tests/shared_ray.py); yields the
    base URL. The module's fixture requests `shared_ray`, so the next module may keep the
    instance and its Serve. The application and its KV allocator end with it."""
    from ray import serve

    from tandem.cluster.kv_allocator import kill_allocator
    from tandem.router.app import build_app
    from tests import shared_ray

    http_port, _ = shared_ray.serve_ports()
    url = f"http://127.0.0.1:{http_port}"
    try:
        serve.run(build_app({"group_num_cpus": 1, **args}), name=APP_NAME, route_prefix="/")
        # A proxy that served an earlier module's application learns of this one's route
        # from the controller, a moment after serve.run returns: the first request waits for it.
        assert wait_for(lambda: _health(url) == 200, timeout_s=60), f"{url}/health: {_health(url)}"
        yield url
    finally:
        shared_ray.delete_app(APP_NAME)
        kill_allocator(APP_NAME)


def _health(url: str) -> int:
    import requests

    try:
        return requests.get(f"{url}/health", timeout=10).status_code
    except requests.RequestException:
        return 0


def group_handle():
    from ray import serve

    return serve.get_deployment_handle("GroupServer", app_name=APP_NAME)


def allocator():
    """The test application's cluster KV allocator actor."""
    import ray

    from tandem.cluster.kv_allocator import ALLOCATOR_NAMESPACE, allocator_name

    return ray.get_actor(allocator_name(APP_NAME), namespace=ALLOCATOR_NAMESPACE)


def held_by(prompt: list[int], block_size: int) -> dict[str, int]:
    """Leading prompt blocks each group holds, as the allocator's directory has it."""
    import ray

    from tandem.workers.core.block_pool import prompt_block_hashes

    return ray.get(allocator().match.remote(prompt_block_hashes(prompt, block_size)), timeout=10)


@pytest.fixture(scope="module")
def tiny_llama() -> str:
    from tests.conftest import tiny_model

    return tiny_model("llama")
