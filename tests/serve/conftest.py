"""Serve test helpers: one Serve instance per test module, on free ports, with tiny models."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tandem.cluster.net import free_port
from tests.conftest import wait_for  # noqa: F401 - the serve tests import it from here

APP_NAME = "tandem"


@contextmanager
def serve_app(args: dict[str, Any]) -> Iterator[str]:
    """Serve, on the shared local Ray (tests/shared_ray.py), with build_app(args); yields the
    base URL. The module's fixture requests `shared_ray`, so the next module may keep the
    instance. Serve and the application's KV allocator end with it."""
    from ray import serve

    from tandem.cluster.kv_allocator import kill_allocator
    from tandem.router.app import build_app
    from tests import shared_ray

    port = free_port()
    shared_ray.acquire()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"group_num_cpus": 1, **args}), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        kill_allocator(APP_NAME)


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
