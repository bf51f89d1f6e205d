"""One local Ray instance that consecutive test modules share.

Starting and stopping a local Ray costs about 8 s of a 2-core machine's time, which every
module that built its own paid. Modules that need a plain local Ray (logical CPUs, no
dashboard) request the `shared_ray` fixture (tests/conftest.py): the first starts it, and
it stays up while the next module requests it too. It is only handed on clean: after each
module every actor must be dead, every placement group removed and every logical CPU free
again within `SETTLE_S`, or it is shut down and the next module starts a fresh one (pytest's
warnings summary names what was left). Before any module that does not request it, it is
shut down, so a module that starts its own Ray, a `Cluster`, or none at all finds no Ray.

Serve, too, is shared: starting it costs about 2 s and `serve.shutdown` about 5 s, against
about 2.5 s for deleting one application. The first Serve module starts it (`serve_ports`,
HTTP and gRPC on free ports) and each Serve module deletes its own applications; Serve's own
actors (its controller and proxies) are not counted as left behind. A module outside
tests/serve gets an instance without Serve (`acquire(keep_serve=False)`), and Serve ends
before the instance does.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from tandem.cluster.local_ray import start_local_ray, stop_local_ray

# Logical CPUs: a TP=2 x PP=2 group (one CPU per worker) and two Serve groups fit on a 2-core machine.
INIT_OPTIONS = {"address": "local", "num_cpus": 8, "include_dashboard": False, "log_to_driver": False}
SETTLE_S = 20.0

GRPC_SERVICER = "tandem.router.grpc_proxy.add_TandemServicer_to_server"
# Serve's own actors: the controller and each node's proxies (with HAProxy, a fallback one too).
SERVE_ACTORS = ("SERVE_CONTROLLER_ACTOR", "SERVE_PROXY_ACTOR")

_gcs_address: str | None = None  # the instance this module started (another may be running)
_serve_ports: tuple[int, int] | None = None  # (HTTP, gRPC) of the Serve running on it, if any


def acquire(keep_serve: bool = True) -> Any:
    """The shared instance, started if none of ours is running (one that is not ours is shut
    down); `keep_serve=False`: without Serve (a running one is shut down)."""
    global _gcs_address, _serve_ports
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _gcs_address:
        stop_local_ray()
    if not ray.is_initialized():
        try:
            start_local_ray(**INIT_OPTIONS)
        except RuntimeError as exc:  # Ray's own processes did not start: say what they said
            raise RuntimeError(f"{exc}\n{_startup_logs()}") from exc
        _gcs_address = ray.get_runtime_context().gcs_address
        _serve_ports = None  # a Serve on an instance gone before release() went with it
    elif not keep_serve:
        stop_serve()
    return ray


def _startup_logs(tail_chars: int = 3000) -> str:
    """The GCS and raylet logs (their ends) of the newest local Ray session this process
    started: why a start failed. Ray names a session after the process that starts it, so the
    other lane's Ray, starting at the same time, is not the one read."""
    import glob
    import os

    sessions = sorted(glob.glob(f"/tmp/ray/session_*_{os.getpid()}"), key=os.path.getmtime)
    logs = f"{sessions[-1]}/logs" if sessions else f"/tmp/ray/session_*_{os.getpid()}/logs"
    parts = []
    for path in sorted(glob.glob(f"{logs}/gcs_server*") + glob.glob(f"{logs}/raylet*")):
        with open(path, errors="replace") as f:
            parts.append(f"--- {path}\n{f.read()[-tail_chars:]}")
    return "\n".join(parts) or f"(no GCS or raylet log in {logs})"


def serve_ports() -> tuple[int, int]:
    """(HTTP port, gRPC port) of Serve on the shared instance, started (on 127.0.0.1, with
    tandem's gRPC servicer) if it is not running."""
    global _serve_ports
    acquire()
    if _serve_ports is None:
        from ray import serve
        from ray.serve.config import gRPCOptions

        from tandem.cluster.net import free_port

        http_port, grpc_port = free_port(), free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
        _serve_ports = (http_port, grpc_port)
    return _serve_ports


def delete_app(name: str) -> None:
    """Delete a Serve application and wait until Serve has let it go. `serve.delete` itself
    looks once a second, and a deletion takes about 2 s (a replica's graceful-shutdown loop),
    so each application's end would cost a whole extra second of it."""
    from ray import serve

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + 60
    while name in serve.status().applications:
        assert time.monotonic() < deadline, f"Serve application {name} was not deleted within 60 s"
        time.sleep(0.1)


def stop_serve() -> None:
    """Shut down the Serve that `serve_ports` started, if it is running."""
    global _serve_ports
    if _serve_ports is None:
        return
    _serve_ports = None
    import ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _gcs_address:
        from ray import serve

        serve.shutdown()


def release() -> None:
    """Shut the shared instance down, if it is running (its Serve first)."""
    global _gcs_address
    if _gcs_address is None:
        return
    import ray

    stop_serve()
    if ray.is_initialized() and ray.get_runtime_context().gcs_address == _gcs_address:
        stop_local_ray()
    _gcs_address = None


def leftovers() -> list[str]:
    """What a module left behind in the shared instance: live actors (not Serve's own, while
    Serve is shared), placement groups, held CPUs."""
    import ray
    from ray._private import state

    def serves(info: dict) -> bool:
        return _serve_ports is not None and (info.get("Name") or "").startswith(SERVE_ACTORS)

    left = [f"actor {info.get('Name') or info['ActorClassName']} ({info['State']})"
            for info in state.actors().values() if info["State"] != "DEAD" and not serves(info)]
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
