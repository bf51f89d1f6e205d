"""KubeRay's rules for a manifest file's documents, as a list of the ones it breaks: what the
CRD schemas cannot say (tests/deploy/test_manifests.py checks every generated manifest).

  - No probe on a Ray head that asks Serve: the RayService controller submits the application
    only once the head pod is Ready, and Serve answers only after that (a deadlock).
  - No probe of ours on a worker: KubeRay adds its own (with Serve's proxy on a RayService's
    workers) only where a container declares none.
  - A RayService has an upgradeStrategy, and its rayClusterConfig none (KubeRay refuses it).
  - GCS fault tolerance through gcsFaultToleranceOptions, a redisAddress and a password from a
    Secret's key, and none of what KubeRay refuses beside it.
  - The application runs with device: cuda (the pods are GPU pods).
  - The Redis the file creates is where the options point, with the password of the same Secret.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

SERVE_PATH = re.compile(r"/-/|/v1/|/health\b")  # Serve's own paths, the ingress's health and API
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


def ray_object(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [obj] = [d for d in docs if d["apiVersion"] == "ray.io/v1"]
    return obj


def cluster_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]


def _touches_serve(probe: dict[str, Any], serve_ports: set[Any]) -> bool:
    action = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc") or {}
    text = " ".join(probe.get("exec", {}).get("command", []))
    path = str(action.get("path", ""))
    return (action.get("port") in serve_ports or SERVE_PATH.match(path) is not None
            or SERVE_PATH.search(text) is not None or any(f":{port}" in text for port in serve_ports))


def rule_violations(docs: list[dict[str, Any]], gcs_fault_tolerance: bool = True) -> list[str]:
    """The rules `docs` breaks; gcs_fault_tolerance=False: a manifest made without it, which
    then has no gcsFaultToleranceOptions and no Redis."""
    obj = ray_object(docs)
    spec, where = cluster_spec(obj), obj["kind"]
    broken: list[str] = []
    serve_ports: set[Any] = {"serve", "grpc", 8000, 9000}
    for group, is_head in [(spec["headGroupSpec"], True), *[(g, False) for g in spec["workerGroupSpecs"]]]:
        name = "head" if is_head else group["groupName"]
        for container in group["template"]["spec"]["containers"]:
            for probe in PROBES:
                if probe not in container:
                    continue
                if not is_head:
                    broken.append(f"{where} {name}: a {probe} of ours (KubeRay's own then stay out)")
                elif _touches_serve(container[probe], serve_ports):
                    broken.append(f"{where} head: a {probe} on Serve (the application waits for the head's readiness)")
    if obj["kind"] == "RayService":
        if "type" not in obj["spec"].get("upgradeStrategy", {}):
            broken.append("RayService: no upgradeStrategy")
        if "upgradeStrategy" in spec:
            broken.append("RayService: an upgradeStrategy in rayClusterConfig (KubeRay refuses it)")
        [app] = yaml.safe_load(obj["spec"]["serveConfigV2"])["applications"]
        if app["args"].get("device") != "cuda":
            broken.append(f"RayService: the application's device is {app['args'].get('device')!r}, not cuda")
    elif "type" not in spec.get("upgradeStrategy", {}):
        broken.append("RayCluster: no upgradeStrategy")
    if gcs_fault_tolerance:
        broken += _gcs_violations(docs, obj, spec)
    elif "gcsFaultToleranceOptions" in spec or len(docs) > 1:
        broken.append("GCS fault tolerance off, yet gcsFaultToleranceOptions or a Redis")
    return broken


def _gcs_violations(docs: list[dict[str, Any]], obj: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    broken = []
    options = spec.get("gcsFaultToleranceOptions")
    if options is None:
        return ["no gcsFaultToleranceOptions"]
    if not options.get("redisAddress"):
        broken.append("gcsFaultToleranceOptions: no redisAddress")
    secret = options.get("redisPassword", {}).get("valueFrom", {}).get("secretKeyRef")
    if not (secret and secret.get("name") and secret.get("key")):
        broken.append("gcsFaultToleranceOptions: the Redis password is not a Secret's key (secretKeyRef)")
    annotations = {**obj["metadata"].get("annotations", {}), **spec["headGroupSpec"]["template"].get(
        "metadata", {}).get("annotations", {})}
    if "ray.io/ft-enabled" in annotations or "ray.io/external-storage-namespace" in annotations:
        broken.append("the ray.io/ft-enabled or external-storage-namespace annotation beside gcsFaultToleranceOptions")
    if {"redis-password", "redis-username"} & set(spec["headGroupSpec"]["rayStartParams"]):
        broken.append("a redis-password / redis-username rayStartParam beside gcsFaultToleranceOptions")
    [head] = spec["headGroupSpec"]["template"]["spec"]["containers"][:1]
    refused = {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME", "RAY_EXTERNAL_STORAGE_NS"}
    if refused & {e["name"] for e in head.get("env", [])}:
        broken.append(f"the head sets {sorted(refused & {e['name'] for e in head['env']})} itself")
    services = [d for d in docs if d["kind"] == "Service"]
    redis = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    for workload in redis:
        pod = workload["spec"]["template"]
        if workload["spec"]["selector"]["matchLabels"].items() > pod["metadata"]["labels"].items():
            broken.append(f"{workload['kind']} {workload['metadata']['name']}: its selector misses its pods")
        env = {e["name"]: e for c in pod["spec"]["containers"] for e in c.get("env", [])}
        if secret and env.get("REDIS_PASSWORD", {}).get("valueFrom", {}).get("secretKeyRef") != secret:
            broken.append(f"{workload['metadata']['name']}: its password is not the Secret the head reads")
        served = [f"{s['metadata']['name']}:{p['port']}" for s in services for p in s["spec"]["ports"]
                  if s["spec"]["selector"].items() <= pod["metadata"]["labels"].items()]
        if options.get("redisAddress") not in served:
            broken.append(f"redisAddress {options.get('redisAddress')} is not the created Redis's Service ({served})")
    return broken


# ---- manifests to check ---------------------------------------------------------------------------
# `tandem deploy kuberay` flags that take every choice of the generator at least once; the tests
# hold each one's output to the rules and the CRDs, as they do the committed files.
VARIANTS: dict[str, list[str]] = {
    "defaults": [],
    "raycluster": ["--kind", "raycluster"],
    "incremental-upgrade": ["--num-replicas", "3", "--upgrade-strategy", "NewClusterWithIncrementalUpgrade",
                            "--gateway-class", "istio"],
    "no-upgrade": ["--upgrade-strategy", "None"],
    "external-redis": ["--redis-address", "redis.infra.svc:6380", "--redis-password-secret", "redis-auth:secret"],
    "no-gcs-fault-tolerance": ["--no-gcs-fault-tolerance", "--kind", "raycluster", "--upgrade-strategy", "None"],
    "model-on-a-claim": ["--model", "/models/llama", "--model-pvc", "llama-weights"],
    "hub-model": ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--cache-pvc", "hf-cache",
                  "--hf-token-secret", "hf"],
    "bucket-model": ["--kind", "raycluster", "--model", "s3://models/llama-3.1-8b"],
    "gpu-nodes": ["--gpu-node-selector", "cloud.google.com/gke-accelerator=nvidia-h100-80gb",
                  "--gpu-toleration", "nvidia.com/gpu=present:NoSchedule", "--gpu-toleration", "dedicated:NoExecute"],
}


def generated(flags: list[str]) -> list[dict[str, Any]]:
    """The documents `tandem deploy kuberay FLAGS` writes."""
    from tandem.cli import deploy as deploy_cli
    from tandem.cli.main import build_parser

    args = build_parser().parse_args(["deploy", "kuberay", *flags])
    return list(yaml.safe_load_all(deploy_cli.render(deploy_cli.kuberay_options(args))))
