"""One local Ray instance per test module (started fresh, never joined), shut down after it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # Logical CPUs: a TP=2 x PP=2 group (one CPU per worker) fits on a 2-core machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
