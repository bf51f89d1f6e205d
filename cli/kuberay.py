"""KubeRay manifests: a RayService (the cluster and the Serve application) or a bare RayCluster,
and the Redis that keeps the GCS's state, as one file of YAML documents.

KubeRay's rules the manifests keep:
  - No probe of ours on a Ray container: KubeRay adds its own (the raylet's and the GCS's
    health; on a RayService's workers also Serve's proxy) only where a container declares
    none. A head probe on Serve would deadlock: the RayService controller submits the Serve
    application only once the head pod is Ready, and Serve's proxy answers only after that.
  - GCS fault tolerance through gcsFaultToleranceOptions only (cli/gcs_ft.py).
  - upgradeStrategy on the RayService, never in its rayClusterConfig (cli/upgrade_strategy.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import yaml

from tandem.cli.gcs_ft import GcsFaultTolerance
from tandem.cli.gpu_scheduling import GpuScheduling
from tandem.cli.k8s import check_name
from tandem.cli.layout import Layout
from tandem.cli.model_source import ModelSource
from tandem.cli.serve_config import load_serve_config, serve_config
from tandem.cli.upgrade_strategy import UpgradeStrategy
from tandem.cluster.direct_ingress import NODE_ENV

KINDS = ("rayservice", "raycluster")
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
# The manifests target GPU pods: with `device: auto` an application built before a GPU node
# joins would run its groups on CPU; `cuda` makes Serve hold them until the GPUs are there.
DEVICE = "cuda"


def pinned_ray_version() -> str:
    """The Ray version tandem pins (`ray[serve]==X` in pyproject.toml): the image, rayVersion
    and the cluster launcher's setup commands all use it."""
    for requirement in metadata.requires("tandem") or ():
        match = re.match(r"ray(\[[\w,]+\])?\s*==\s*([\w.]+)\s*$", requirement.split(";")[0].strip())
        if match:
            return match.group(2)
    raise ValueError("pyproject.toml does not pin ray (ray[serve]==X.Y.Z)")


@dataclass(frozen=True)
class KubeRayOptions:
    """Everything `tandem deploy kuberay` takes; `flags()` is the command that makes the same manifest."""

    kind: str = "rayservice"
    layout: Layout = field(default_factory=Layout)
    name: str = "tandem"
    image: str = DEFAULT_IMAGE
    config_path: str | None = None  # None: tandem's deploy/serve_config.yaml (package data)
    upgrade: UpgradeStrategy = field(default_factory=UpgradeStrategy)
    gcs_ft: GcsFaultTolerance = field(default_factory=GcsFaultTolerance)
    gpu: GpuScheduling = field(default_factory=GpuScheduling)
    model: ModelSource = field(default_factory=ModelSource)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be rayservice or raycluster, got {self.kind!r}")
        if self.upgrade.kind != self.kind:
            raise ValueError(f"upgrade strategy: made for a {self.upgrade.kind}, not a {self.kind}")
        check_name("name", self.name)

    def flags(self) -> list[str]:
        flags = ["--kind", self.kind, *self.layout.flags()]
        if self.config_path is not None:
            flags += ["--config", self.config_path]
        if self.name != "tandem":
            flags += ["--name", self.name]
        if self.image != DEFAULT_IMAGE:
            flags += ["--image", self.image]
        return flags + self.model.flags() + self.upgrade.flags() + self.gcs_ft.flags() + self.gpu.flags()


# ---- pods ----------------------------------------------------------------------------------------
def _container(name: str, image: str, resources: dict[str, Any], ports: list[tuple[str, int]],
               model: ModelSource) -> dict[str, Any]:
    return {
        "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
        # HAProxy in front of the ingress (cluster/direct_ingress.py): Ray reads it when its
        # processes start, so it belongs to the pod (the image has it too; another image may not).
        "env": [{"name": k, "value": v} for k, v in NODE_ENV.items()] + model.env(),
        "resources": {"limits": dict(resources), "requests": dict(resources)},
        # NCCL moves tensors through /dev/shm; a container's default is 64 MiB.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}] + model.volume_mounts(),
        "ports": [{"name": n, "containerPort": p} for n, p in ports],
    }


def _pod(container: dict[str, Any], model: ModelSource, extra_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    # The annotations let an annotation-driven Prometheus scrape every Ray pod's metrics;
    # with prometheus-operator, a PodMonitor on the `metrics` port does the same.
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                   "prometheus.io/path": "/metrics"}
    spec: dict[str, Any] = {"containers": [container], **(extra_spec or {}),
                            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}] + model.volumes()}
    if model.pod_security_context():
        spec["securityContext"] = model.pod_security_context()
    return {"metadata": {"annotations": annotations}, "spec": spec}


def node_port_params() -> dict[str, str]:
    """The rayStartParams (strings, as the CRD wants) that fix every node's agent and metrics ports.
    The pods declare none of the agents' ports: Kubernetes does not gate traffic on a
    containerPort, and KubeRay's probes take the agent's port from these parameters."""
    return {"metrics-export-port": str(METRICS_PORT),
            "dashboard-agent-listen-port": str(DASHBOARD_AGENT_LISTEN_PORT),
            "dashboard-agent-grpc-port": str(DASHBOARD_AGENT_GRPC_PORT),
            "runtime-env-agent-port": str(RUNTIME_ENV_AGENT_PORT)}


def ray_cluster_spec(options: KubeRayOptions, ray_version: str) -> dict[str, Any]:
    """A RayCluster spec: a CPU head (GCS, dashboard, Serve controller and proxy, ingress) and
    one GPU worker group sized for the layout. The head and the workers both load the model:
    the ingress (on any node) tokenizes, the groups (on the GPU pods) run it."""
    layout, model = options.layout, options.model
    head = _container("ray-head", options.image, {"cpu": "8", "memory": "32Gi"},
                      [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001),
                       ("serve", SERVE_PORT), ("grpc", GRPC_PORT), ("metrics", METRICS_PORT)], model)
    # `serve` names the port of the readiness probe KubeRay gives a RayService's workers.
    worker = _container("ray-worker", options.image,
                        {"cpu": str(8 * layout.gpus_per_node), "memory": "64Gi",
                         "nvidia.com/gpu": str(layout.gpus_per_node)},
                        [("serve", SERVE_PORT), ("metrics", METRICS_PORT)], model)
    pods = layout.num_worker_pods
    # The incremental upgrade moves Serve's target capacity, and Ray's autoscaler turns the
    # groups that asks for into GPU pods: the group starts empty and grows as groups land.
    autoscaled = options.kind == "rayservice" and options.upgrade.is_incremental
    spec: dict[str, Any] = {
        "rayVersion": ray_version,
        "enableInTreeAutoscaling": autoscaled,
        "authOptions": {"mode": "token"},  # Ray's own RPCs and dashboard; not Serve's HTTP/gRPC
    }
    gcs_options = options.gcs_ft.options(options.name)
    if gcs_options is not None:
        spec["gcsFaultToleranceOptions"] = gcs_options
    if options.kind == "raycluster":
        spec["upgradeStrategy"] = options.upgrade.spec(layout.num_replicas)
    spec["headGroupSpec"] = {
        # num-cpus 0: no replica group lands on the head; it has no GPUs anyway.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", **node_port_params()},
        "template": _pod(head, model),
    }
    spec["workerGroupSpecs"] = [{
        "groupName": "gpu",
        "replicas": 0 if autoscaled else pods, "minReplicas": 0 if autoscaled else pods, "maxReplicas": pods,
        "rayStartParams": {"num-gpus": str(layout.gpus_per_node), **node_port_params()},
        "template": _pod(worker, model, options.gpu.pod_spec()),
    }]
    return spec


# ---- manifests -----------------------------------------------------------------------------------
def app_serve_config(options: KubeRayOptions) -> dict[str, Any]:
    """The Serve config the RayService carries: the layout, the model and `device: cuda` applied."""
    return serve_config(load_serve_config(options.config_path), options.layout,
                        model=options.model.app_model, device=DEVICE)


def rayservice(options: KubeRayOptions, ray_version: str) -> dict[str, Any]:
    name = options.name
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "upgradeStrategy": options.upgrade.spec(options.layout.num_replicas),
            "serveConfigV2": yaml.safe_dump(app_serve_config(options), sort_keys=False),
            # The Service in front of Serve's proxies: the OpenAI API and gRPC.
            "serveService": {"metadata": {"name": f"{name}-serve"},
                             "spec": {"ports": [{"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT},
                                                {"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT}]}},
            "rayClusterConfig": ray_cluster_spec(options, ray_version),
        },
    }


def raycluster(options: KubeRayOptions, ray_version: str) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": options.name},
            "spec": ray_cluster_spec(options, ray_version)}


def documents(options: KubeRayOptions, ray_version: str | None = None) -> list[dict[str, Any]]:
    """The file's documents, in the order to create them: Redis first, so the head finds it."""
    ray_version = ray_version or pinned_ray_version()
    build = rayservice if options.kind == "rayservice" else raycluster
    return [*options.gcs_ft.redis_objects(options.name), build(options, ray_version)]
