"""The distributed tests' Ray: the local instance consecutive modules share (tests/shared_ray.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    return shared_ray
