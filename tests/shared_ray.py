"""One local Ray instance that consecutive test modules share.

Starting and stopping a local Ray costs about 8 s of a 2-core machine's time, which every
module that built its own paid. Modules that need a plain local Ray (logical CPUs, no
dashboard) request the `shared_ray` fixture (tests/conftest.py): the first starts it, and
it stays up while the next module requests it too. It is only handed on clean: after each
module every actor must be dead, every placement group removed and every logical CPU free
again within `SETTLE_S`, or it is shut down and the next module starts a fresh one (pytest's
warnings summary names what was left). Before any module that does not request it, it is
shut down, so a module that starts its own Ray, a `Cluster`, or none at all finds no Ray.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

# Logical CPUs: a TP=2 x PP=2 group (one CPU per worker) and two Serve groups fit on a 2-core machine.
INIT_OPTIONS = {"address": "local", "num_cpus": 8, "include_dashboard": False, "log_to_driver": False}
SETTLE_S = 20.0

_gcs_address: str | None = None  # the instance this module started (another may be running)


def acquire() -> Any:
    """The shared instance, started if none of ours is running (one that is not ours is shut down)."""
    global _gcs_address
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _gcs_address:
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(**INIT_OPTIONS)
        _gcs_address = ray.get_runtime_context().gcs_address
    return ray


def release() -> None:
    """Shut the shared instance down, if it is running."""
    global _gcs_address
    if _gcs_address is None:
        return
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _gcs_address:
        ray.shutdown()
    _gcs_address = None


def leftovers() -> list[str]:
    """What a module left behind in the shared instance: live actors, placement groups, held CPUs."""
    import ray
    from ray._private import state

    left = [f"actor {info.get('Name') or info['ActorClassName']} ({info['State']})"
            for info in state.actors().values() if info["State"] != "DEAD"]
    left += [f"placement group {pg_id[:8]} ({info['state']})"
             for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
    free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
    if free != total:
        left.append(f"{total - free:g} of {total:g} CPUs held")
    return left


def leftovers_after(timeout_s: float) -> list[str]:
    """What is still left once `timeout_s` has passed, or nothing as soon as all is gone
    (actors die and CPUs come back asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def settle(module: str) -> None:
    """After `module`: the instance stays up if it is clean within SETTLE_S; otherwise it is
    shut down, with what was left in a warning."""
    import ray

    if _gcs_address is None or not ray.is_initialized():
        return
    if left := leftovers_after(SETTLE_S):
        warnings.warn(f"shared Ray: {module} left {', '.join(left)}; the next module gets a fresh instance",
                      stacklevel=2)
        release()
