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
def serve_app(args: dict[str, Any], *, num_cpus: int = 8) -> Iterator[str]:
    """Start Ray (local, logical CPUs) and Serve with build_app(args); yields the base URL."""
    import ray
    from ray import serve

    from tandem.router.app import build_app

    port = free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"group_num_cpus": 1, **args}), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


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
