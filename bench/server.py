"""The tandem server a benchmark loads: Ray and Serve on this machine, tandem's applications at
their route prefixes, on a free port, healthy before the benchmark starts.

The bench builds applications through an `AppBuilder` it is handed (cli/main.py hands in
`router.serve_cli.local_app`): the bench never imports the router.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tandem.cluster.direct_ingress import default_proxy, use_proxy

AppBuilder = Callable[[dict[str, Any]], Any]  # engine and serving options -> a Serve application
SERVED_MODEL_NAME = "tandem-bench"
HEALTH_TIMEOUT_S = 120.0


@contextmanager
def bench_server(local_app: AppBuilder, apps: dict[str, dict[str, Any]], *, num_cpus: int,
                 address: str | None = None, grpc: tuple[int, str] | None = None,
                 proxy: str | None = None) -> Iterator[dict[str, str]]:
    """Serve each of `apps` ({route: options}; route "" is the root) and yield {route: base URL}.

    `grpc`: (port, servicer function's import path): Serve's gRPC proxy too, on that port.

    Without `address`: a local Ray of `num_cpus` logical CPUs with `proxy` in front of the
    ingress (cluster/direct_ingress.py; None: HAProxy where installed), or the Ray this
    process is already connected to, and a Serve instance of our own, shut down at the end.
    With one: that cluster, whose Serve and other applications outlive ours (its own proxy)."""
    import ray

    owns_ray = not ray.is_initialized()
    if owns_ray and not address:
        use_proxy(proxy or default_proxy())  # before Ray starts: its processes read it once
    from ray import serve

    from tandem.bench.load_generator import httpx
    from tandem.cluster.local_ray import start_local_ray, stop_local_ray
    from tandem.cluster.net import free_port

    names = {route: SERVED_MODEL_NAME + (f"-{route}" if route else "") for route in apps}
    # Built before Ray starts, so bad options fail at once.
    applications = {route: local_app({**options, "served_model_name": SERVED_MODEL_NAME})
                    for route, options in apps.items()}
    if owns_ray and address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    elif owns_ray:
        start_local_ray(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        grpc_options = {"port": grpc[0], "grpc_servicer_functions": [grpc[1]]} if grpc else None
        serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options)
        # One call for every app: Serve starts their replicas side by side, not one app after another.
        serve.run_many([serve.RunTarget(application, name=names[route], route_prefix=f"/{route}")
                        for route, application in applications.items()])
        urls = {route: f"http://127.0.0.1:{port}" + (f"/{route}" if route else "") for route in applications}
        for url in urls.values():
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while httpx.get(url + "/health", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, f"{url} never became healthy"
                time.sleep(0.5)
        yield urls
    finally:
        if address:
            for name in names.values():
                serve.delete(name)
        else:
            serve.shutdown()
        if owns_ray:
            stop_local_ray()
