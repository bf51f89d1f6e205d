"""`tandem deploy kuberay`: KubeRay manifests generated from deploy/serve_config.yaml.

    tandem deploy kuberay [--kind rayservice|raycluster] [--config deploy/serve_config.yaml]
        [--num-replicas N] [-tp T] [-pp P] [--gpus-per-node G] [--spare-gpus S] [--model DIR]
        [--image IMAGE] [--name NAME] [--output FILE]

The Serve application lives in one place, deploy/serve_config.yaml; a RayService carries
it as `serveConfigV2` (a YAML string) with the layout flags applied, and its GPU worker
group is sized for the layout: `num_replicas x TP x PP` GPUs plus `--spare-gpus` (draft
models), in pods of `--gpus-per-node` GPUs. A stage's TP ranks share a node, so TP may not
exceed the GPUs of one pod. deploy/kuberay/*.yaml are this command's output with its
defaults; a test regenerates them and fails when they differ.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from tandem.cluster.direct_ingress import NODE_ENV

DEFAULT_CONFIG = "deploy/serve_config.yaml"
DEFAULT_IMAGE = "registry.example.com/tandem:0.1.0"  # built from deploy/Dockerfile
SERVE_PORT, GRPC_PORT = 8000, 9000
METRICS_PORT = 8080  # each Ray node's Prometheus endpoint (tandem_*, ray_serve_*): deploy/prometheus.yml
# Every node's agents get fixed ports: with port 0 the raylet waits ~15 s for each agent to
# write the port it took to a file, and on a loaded node that wait times out and the raylet
# crashes (one wait stays: deploy/README.md, "Ports"). 52365 is Ray's own default, which
# KubeRay's health probes read from rayStartParams; 8078 and 8079 sit beside the metrics port,
# outside Ray's worker ports (10002-19999) and the kernel's ephemeral range.
# deploy/ray-cluster.yaml passes the same ports (a test holds them equal).
DASHBOARD_AGENT_LISTEN_PORT, DASHBOARD_AGENT_GRPC_PORT, RUNTIME_ENV_AGENT_PORT = 52365, 8078, 8079


def pinned_ray_version() -> str:
    """The Ray version tandem pins (`ray[serve]==X` in pyproject.toml): the image, rayVersion
    and the cluster launcher's setup commands all use it."""
    for requirement in metadata.requires("tandem") or ():
        match = re.match(r"ray(\[[\w,]+\])?\s*==\s*([\w.]+)\s*$", requirement.split(";")[0].strip())
        if match:
            return match.group(2)
    raise ValueError("pyproject.toml does not pin ray (ray[serve]==X.Y.Z)")


@dataclass(frozen=True)
class Layout:
    """What the replica groups need: the layout flags, and how many GPUs a pod has."""

    num_replicas: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpus_per_node: int = 1
    spare_gpus: int = 0  # for draft models (speculative_model), beside the groups' GPUs
    model: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_replicas", "tensor_parallel_size", "pipeline_parallel_size", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.spare_gpus < 0:
            raise ValueError(f"spare_gpus: must be at least 0, got {self.spare_gpus}")
        if self.tensor_parallel_size > self.gpus_per_node:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs that many GPUs on one node, "
                             f"but a worker pod has gpus_per_node={self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.tensor_parallel_size * self.pipeline_parallel_size + self.spare_gpus

    @property
    def num_worker_pods(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)


def load_serve_config(path: str | Path = DEFAULT_CONFIG) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def serve_config(base: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """`base` (a Serve config with the tandem application) with the layout's arguments."""
    config = copy.deepcopy(base)
    [app] = [a for a in config["applications"] if a["import_path"] == "tandem.router.app:build_app"]
    args = app.setdefault("args", {})
    args.update(tensor_parallel_size=layout.tensor_parallel_size,
                pipeline_parallel_size=layout.pipeline_parallel_size, num_replicas=layout.num_replicas)
    if layout.model is not None:
        args["model"] = layout.model
    return config


# ---- KubeRay ---------------------------------------------------------------------------------------
def _container(name: str, image: str, resources: dict[str, Any], ports: list[tuple[str, int]]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
        # HAProxy in front of the ingress (cluster/direct_ingress.py): Ray reads it when its
        # processes start, so it belongs to the pod (the image has it too; another image may not).
        "env": [{"name": k, "value": v} for k, v in NODE_ENV.items()],
        "resources": {"limits": dict(resources), "requests": dict(resources)},
        # NCCL moves tensors through /dev/shm; a container's default is 64 MiB.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if ports:
        container["ports"] = [{"name": n, "containerPort": p} for n, p in ports]
    return container


def _pod(container: dict[str, Any]) -> dict[str, Any]:
    # The annotations let an annotation-driven Prometheus scrape every Ray pod's metrics;
    # with prometheus-operator, a PodMonitor on the `metrics` port does the same.
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                   "prometheus.io/path": "/metrics"}
    return {"metadata": {"annotations": annotations},
            "spec": {"containers": [container],
                     "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}


def node_port_params() -> dict[str, str]:
    """The rayStartParams (strings, as the CRD wants) that fix every node's agent and metrics ports.
    The pods declare none of the agents' ports: Kubernetes does not gate traffic on a
    containerPort, and KubeRay's probes take the agent's port from these parameters."""
    return {"metrics-export-port": str(METRICS_PORT),
            "dashboard-agent-listen-port": str(DASHBOARD_AGENT_LISTEN_PORT),
            "dashboard-agent-grpc-port": str(DASHBOARD_AGENT_GRPC_PORT),
            "runtime-env-agent-port": str(RUNTIME_ENV_AGENT_PORT)}


def ray_cluster_spec(layout: Layout, image: str, ray_version: str) -> dict[str, Any]:
    """A RayCluster spec: a CPU head (GCS, dashboard, Serve controller and proxy, ingress)
    and one GPU worker group sized for the layout."""
    head = _container("ray-head", image, {"cpu": "8", "memory": "32Gi"},
                      [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001),
                       ("serve", SERVE_PORT), ("grpc", GRPC_PORT), ("metrics", METRICS_PORT)])
    # Serve's proxy answers /-/healthz once it runs; the application's own readiness (every
    # replica group up) is what RayService waits for before it sends traffic.
    head["readinessProbe"] = {"httpGet": {"path": "/-/healthz", "port": SERVE_PORT},
                              "initialDelaySeconds": 10, "periodSeconds": 5}
    worker = _container("ray-worker", image, {"cpu": str(8 * layout.gpus_per_node), "memory": "64Gi",
                                              "nvidia.com/gpu": str(layout.gpus_per_node)}, [("metrics", METRICS_PORT)])
    pods = layout.num_worker_pods
    return {
        "rayVersion": ray_version,
        "enableInTreeAutoscaling": False,
        "authOptions": {"mode": "token"},  # Ray's own RPCs and dashboard; not Serve's HTTP/gRPC
        "headGroupSpec": {
            # num-cpus 0: no replica group lands on the head; it has no GPUs anyway.
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", **node_port_params()},
            "template": _pod(head),
        },
        "workerGroupSpecs": [{
            "groupName": "gpu",
            "replicas": pods, "minReplicas": pods, "maxReplicas": pods,
            "rayStartParams": {"num-gpus": str(layout.gpus_per_node), **node_port_params()},
            "template": _pod(worker),
        }],
    }


def rayservice(config: dict[str, Any], layout: Layout, *, name: str, image: str, ray_version: str) -> dict[str, Any]:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(config, sort_keys=False),
            # The Service in front of Serve's proxies: the OpenAI API and gRPC.
            "serveService": {"metadata": {"name": f"{name}-serve"},
                             "spec": {"ports": [{"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT},
                                                {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT}]}},
            "rayClusterConfig": ray_cluster_spec(layout, image, ray_version),
        },
    }


def raycluster(layout: Layout, *, name: str, image: str, ray_version: str) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name},
            "spec": ray_cluster_spec(layout, image, ray_version)}


def render(kind: str, layout: Layout, *, config_path: str = DEFAULT_CONFIG, image: str = DEFAULT_IMAGE,
           name: str = "tandem", ray_version: str | None = None) -> str:
    """The manifest as YAML text, headed by what to edit and how it was made."""
    ray_version = ray_version or pinned_ray_version()
    flags = (f"--num-replicas {layout.num_replicas} -tp {layout.tensor_parallel_size} "
             f"-pp {layout.pipeline_parallel_size} --gpus-per-node {layout.gpus_per_node}")
    if layout.spare_gpus:
        flags += f" --spare-gpus {layout.spare_gpus}"
    if kind == "rayservice":
        manifest = rayservice(serve_config(load_serve_config(config_path), layout), layout,
                              name=name, image=image, ray_version=ray_version)
        use = (f"# `kubectl apply -f` this file; the OpenAI API and gRPC are the Service {name}-serve (ports\n"
               f"# {SERVE_PORT} and {GRPC_PORT}). Upgrade in place: change the config, regenerate, apply again.\n")
    elif kind == "raycluster":
        manifest = raycluster(layout, name=name, image=image, ray_version=ray_version)
        use = (f"# A bare Ray cluster (batch jobs, notebooks): `kubectl apply -f` this file, then deploy the\n"
               f"# application with `serve deploy {config_path}` through the head's dashboard (port 8265).\n")
    else:
        raise ValueError(f"kind: must be rayservice or raycluster, got {kind!r}")
    header = (f"# Generated by `tandem deploy kuberay --kind {kind} {flags}`\n"
              f"# from {config_path}: edit that file or the flags and regenerate, not this file.\n" + use +
              f"# Edit for your cluster: `image` (deploy/Dockerfile pushed to your registry), the pods'\n"
              f"# cpu / memory, and `nvidia.com/gpu` with --gpus-per-node.\n"
              f"# GPUs: {layout.num_gpus} = {layout.num_replicas} group(s) x TP {layout.tensor_parallel_size} x PP "
              f"{layout.pipeline_parallel_size} + {layout.spare_gpus} spare, in {layout.num_worker_pods} pod(s).\n")
    return header + yaml.dump(manifest, Dumper=_BlockDumper, sort_keys=False, width=100)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, readable in the manifest."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


# ---- command line ----------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    p = subparsers.add_parser("deploy", help="deployment manifests (KubeRay) from the Serve config")
    sub = p.add_subparsers(dest="target", required=True)
    k = sub.add_parser("kuberay", help="a RayService (or RayCluster) manifest from deploy/serve_config.yaml")
    k.add_argument("--kind", choices=["rayservice", "raycluster"], default="rayservice")
    k.add_argument("--config", default=DEFAULT_CONFIG, help="the Serve config the RayService carries")
    k.add_argument("--num-replicas", type=int, default=1, help="replica groups")
    k.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    k.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    k.add_argument("--gpus-per-node", type=int, default=1, help="GPUs of one worker pod")
    k.add_argument("--spare-gpus", type=int, default=0, help="GPUs beyond the groups' (draft models)")
    k.add_argument("--model", default=None, help="model directory, present at that path in every pod")
    k.add_argument("--image", default=DEFAULT_IMAGE, help="the image built from deploy/Dockerfile")
    k.add_argument("--name", default="tandem")
    k.add_argument("--output", "-o", default=None, help="write here (default: stdout)")
    k.set_defaults(func=_cmd_kuberay)


def _cmd_kuberay(args: argparse.Namespace) -> int:
    layout = Layout(args.num_replicas, args.tensor_parallel_size, args.pipeline_parallel_size,
                    args.gpus_per_node, args.spare_gpus, args.model)
    text = render(args.kind, layout, config_path=args.config, image=args.image, name=args.name)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
