"""Every file in deploy/ is checked: the cluster launcher config against Ray's own schema,
the KubeRay manifests against the real CRDs' openAPIV3Schema (strictly: unknown fields
fail) and against their generator, and the versions everywhere against pyproject.toml."""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.cli import deploy as deploy_cli
from tandem.cli.main import build_parser
from tests.deploy.kuberay_rules import VARIANTS, cluster_spec, generated, ray_object, rule_violations

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRDS = ROOT.parent / "shared" / "schemas" / "kuberay"
MANIFESTS = {"rayservice.yaml": "ray.io_rayservices.yaml", "raycluster.yaml": "ray.io_rayclusters.yaml"}


def pinned(name: str) -> str:
    """The version pyproject.toml pins for `name` (==), or .ci/run for torch."""
    if name == "torch":
        return re.search(r"torch==([\w.]+)", (ROOT / ".ci/run").read_text()).group(1)
    match = re.search(rf'"{re.escape(name)}(?:\[[\w,]+\])?==([\w.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, f"pyproject.toml does not pin {name} with =="
    return match.group(1)


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def kuberay_docs(name: str) -> list[dict[str, Any]]:
    """deploy/kuberay/<name>'s documents: the Redis's, then the RayService or RayCluster."""
    return list(yaml.safe_load_all((DEPLOY / "kuberay" / name).read_text()))


def load_kuberay(name: str) -> dict[str, Any]:
    """deploy/kuberay/<name>'s RayService or RayCluster."""
    return ray_object(kuberay_docs(name))


def test_every_file_in_deploy_is_covered_here() -> None:
    files = sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file())
    # serve_config.yaml: tests/serve; grafana/tandem.json's queries: tests/serve/test_observability.py
    assert files == ["Dockerfile", "README.md", "__init__.py", "grafana/tandem.json", "kuberay/raycluster.yaml",
                     "kuberay/rayservice.yaml", "prometheus.yml", "ray-cluster.yaml", "serve_config.yaml",
                     "try_multi_node.sh"]


def test_prometheus_yml_is_a_valid_config_reading_rays_discovery_file() -> None:
    config = load("prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"] == [{"files": ["/tmp/ray/prom_metrics_service_discovery.json"]}]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed: only the YAML was checked")
    check = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_grafana_dashboard_queries_only_tandem_and_serve_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "tandem.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    assert len(exprs) >= len(dashboard["panels"]) - sum(p["type"] == "row" for p in dashboard["panels"])
    # vLLM's names (vllm:*, after deploy/prometheus.yml's relabel rule; never ray_vllm_*, Ray's name
    # before it) where vLLM has the metric, tandem's own (ray_tandem_*) for the rest, Serve's (ray_serve_*).
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    names = {name for query in exprs + variables for name in re.findall(r"\b(vllm:\w+|ray_\w+)", query)}
    assert all(name.startswith(("vllm:", "ray_tandem_", "ray_serve_")) for name in names), names
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total", "vllm:request_success_total"} <= names
    assert {"ray_tandem_model_bandwidth_utilization", "ray_tandem_model_flops_utilization"} <= names


def test_kuberay_pods_expose_and_annotate_the_metrics_port() -> None:
    for name in MANIFESTS:
        spec = cluster_spec(load_kuberay(name))
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            assert group["rayStartParams"]["metrics-export-port"] == "8080"
            assert group["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8080"
            (container,) = group["template"]["spec"]["containers"]
            assert {"name": "metrics", "containerPort": 8080} in container["ports"]


# ---- the cluster launcher ---------------------------------------------------------------------------
def _validate_launcher_config(config: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` does before anything else


def test_ray_cluster_yaml_passes_rays_own_schema() -> None:
    config = load("ray-cluster.yaml")
    _validate_launcher_config(config)
    assert config["head_node_type"] in config["available_node_types"]
    assert "RAY_AUTH_MODE=token" in " ".join(config["head_start_ray_commands"])

    # The head deploys the checkout's serve_config.yaml with `device: cuda`: the groups wait for
    # the GPU workers (device: auto would put them on CPU if the application came up first).
    [serve_config, deploy] = config["head_start_ray_commands"][-1].split(" && ")
    args = build_parser().parse_args(shlex.split(serve_config)[1:])
    assert (args.target, args.config, args.device) == ("serve-config", "/home/ray/tandem/deploy/serve_config.yaml",
                                                       "cuda")
    assert deploy == f"RAY_AUTH_MODE=token serve deploy {args.output}"


def test_the_launcher_schema_check_rejects_a_misspelt_field() -> None:
    from jsonschema import ValidationError

    config = load("ray-cluster.yaml")
    config["docker"]["run_option"] = config["docker"].pop("run_options")
    with pytest.raises(ValidationError, match="run_option"):
        _validate_launcher_config(config)


# ---- versions -------------------------------------------------------------------------------------
def test_ray_and_torch_versions_agree_everywhere() -> None:
    ray, torch = pinned("ray"), pinned("torch")
    assert deploy_cli.pinned_ray_version() == ray  # the installed metadata: pip install -e . is current
    import ray as ray_module

    assert ray_module.__version__ == ray, "the installed Ray is not the pinned one"

    launcher = load("ray-cluster.yaml")
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray)}-py3\d+-gpu", launcher["docker"]["image"])
    setup = " ".join(launcher["setup_commands"])
    assert f"torch=={torch}" in setup and f'"ray[serve]=={ray}"' in setup

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    [base] = re.findall(r"(?m)^FROM (\S+)", dockerfile)
    assert base == launcher["docker"]["image"]
    assert f"pip install --no-cache-dir torch=={torch}" in dockerfile and f'"ray[serve]=={ray}"' in dockerfile

    for name in MANIFESTS:
        assert cluster_spec(load_kuberay(name))["rayVersion"] == ray


# ---- KubeRay -------------------------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever it lists properties and does not
    keep unknown fields, so that a misspelt field fails (../shared/schemas/README.md)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields") \
                and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_validator(crd_file: str):
    if not CRDS.is_dir():
        pytest.skip(f"the KubeRay CRDs are not here ({CRDS}); see ../shared/schemas/README.md")
    return _cached_crd_validator(crd_file)


@functools.cache  # a CRD is a large YAML file: read once for the tests that check against it
def _cached_crd_validator(crd_file: str):
    from jsonschema import Draft7Validator

    # libyaml's loader where PyYAML has it: the same safe loading, several times faster on this file.
    crd = yaml.load((CRDS / crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _errors(validator, manifest: dict[str, Any]) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest))


@functools.cache
def _k8s_validators() -> dict[str, Any]:
    """Strict validators of core Kubernetes objects, taken from where the CRDs embed them: a pod
    template (a head group's), a Service's spec (a RayService's serveService) and a claim's spec
    (a pod's ephemeral volume)."""
    from jsonschema import Draft7Validator

    cluster = _crd_validator(MANIFESTS["raycluster.yaml"]).schema["properties"]["spec"]["properties"]
    service = _crd_validator(MANIFESTS["rayservice.yaml"]).schema["properties"]["spec"]["properties"]
    template = cluster["headGroupSpec"]["properties"]["template"]
    volume = template["properties"]["spec"]["properties"]["volumes"]["items"]["properties"]
    claim = volume["ephemeral"]["properties"]["volumeClaimTemplate"]["properties"]["spec"]
    return {"template": Draft7Validator(template), "claim": Draft7Validator(claim),
            "service": Draft7Validator(service["serveService"]["properties"]["spec"])}


def _manifest_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Each document against its schema: a RayService or RayCluster against its CRD; the Redis's
    Service and StatefulSet as well-formed objects whose specs pass Kubernetes' own schemas."""
    crds = {"RayService": MANIFESTS["rayservice.yaml"], "RayCluster": MANIFESTS["raycluster.yaml"]}
    errors = []
    for doc in docs:
        where = f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if doc.get("kind") in crds:
            errors += [f"{where}: {e}" for e in _errors(_crd_validator(crds[doc["kind"]]), doc)]
            continue
        k8s = _k8s_validators()
        if (doc.get("apiVersion"), doc.get("kind")) not in {("v1", "Service"), ("apps/v1", "StatefulSet")} \
                or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"].get("name", "")):
            errors.append(f"{where}: not a Service or StatefulSet with a name")
        elif doc["kind"] == "Service":
            errors += [f"{where}: {e}" for e in _errors(k8s["service"], doc["spec"])]
        else:
            errors += [f"{where}: {e}" for e in _errors(k8s["template"], doc["spec"]["template"])]
            for claim in doc["spec"]["volumeClaimTemplates"]:
                errors += [f"{where}: {e}" for e in _errors(k8s["claim"], claim["spec"])]
    return errors


@functools.cache  # read and generated once for the tests below, which only read them
def _checked_manifests() -> dict[str, tuple[list[dict[str, Any]], bool]]:
    """name -> (its documents, made with GCS fault tolerance): the committed files and VARIANTS."""
    manifests = {name: (kuberay_docs(name), True) for name in MANIFESTS}
    return manifests | {name: (generated(flags), "--no-gcs-fault-tolerance" not in flags)
                        for name, flags in VARIANTS.items()}


@pytest.mark.parametrize("name", [*sorted(MANIFESTS), *VARIANTS])
def test_kuberay_manifest_passes_the_crd_schema(name: str) -> None:
    docs, _ = _checked_manifests()[name]
    assert _manifest_errors(docs) == []
    spec = cluster_spec(ray_object(docs))
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        [container] = group["template"]["spec"]["containers"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    [worker] = spec["workerGroupSpecs"]
    gpus = worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == worker["rayStartParams"]["num-gpus"]


@pytest.mark.parametrize("name", [*sorted(MANIFESTS), *VARIANTS])
def test_kuberay_manifest_keeps_kuberays_rules(name: str) -> None:
    """What the CRDs cannot say (tests/deploy/kuberay_rules.py): no probe of ours that waits on
    Serve or hides KubeRay's, an upgradeStrategy, GCS fault tolerance through its options with a
    Secret's password, device: cuda, and a created Redis where the options point."""
    docs, gcs_fault_tolerance = _checked_manifests()[name]
    assert rule_violations(docs, gcs_fault_tolerance) == []


def test_the_rule_check_catches_each_broken_rule() -> None:
    docs = kuberay_docs("rayservice.yaml")

    def broken(change) -> list[str]:
        bad = copy.deepcopy(docs)
        change(bad, ray_object(bad), cluster_spec(ray_object(bad)))
        return rule_violations(bad)

    def container(spec: dict[str, Any], group: str) -> dict[str, Any]:
        pod = spec["headGroupSpec"] if group == "head" else spec["workerGroupSpecs"][0]
        return pod["template"]["spec"]["containers"][0]

    def app_args(obj: dict[str, Any], **args: Any) -> None:
        config = yaml.safe_load(obj["spec"]["serveConfigV2"])
        config["applications"][0]["args"].update(args)
        obj["spec"]["serveConfigV2"] = yaml.safe_dump(config)

    assert rule_violations(docs) == []
    assert broken(lambda d, o, s: container(s, "head").update(
        readinessProbe={"httpGet": {"path": "/-/healthz", "port": 8000}})) == [
        "RayService head: a readinessProbe on Serve (the application waits for the head's readiness)"]
    assert broken(lambda d, o, s: container(s, "head").update(
        livenessProbe={"exec": {"command": ["bash", "-c", "wget -qO- localhost:8000/-/healthz"]}})) == [
        "RayService head: a livenessProbe on Serve (the application waits for the head's readiness)"]
    assert broken(lambda d, o, s: container(s, "head").update(
        readinessProbe={"httpGet": {"path": "/api/healthz", "port": 52365}})) == []  # Ray's own health is fine
    assert broken(lambda d, o, s: container(s, "gpu").update(livenessProbe={"tcpSocket": {"port": 52365}})) == [
        "RayService gpu: a livenessProbe of ours (KubeRay's own then stay out)"]
    assert broken(lambda d, o, s: o["spec"].pop("upgradeStrategy")) == ["RayService: no upgradeStrategy"]
    assert broken(lambda d, o, s: s.update(upgradeStrategy={"type": "Recreate"})) == [
        "RayService: an upgradeStrategy in rayClusterConfig (KubeRay refuses it)"]
    assert broken(lambda d, o, s: app_args(o, device="auto")) == [
        "RayService: the application's device is 'auto', not cuda"]
    assert broken(lambda d, o, s: s.pop("gcsFaultToleranceOptions")) == ["no gcsFaultToleranceOptions"]
    assert broken(lambda d, o, s: s["gcsFaultToleranceOptions"].update(redisPassword={"value": "hunter2"})) == [
        "gcsFaultToleranceOptions: the Redis password is not a Secret's key (secretKeyRef)"]
    assert broken(lambda d, o, s: o["metadata"].update(annotations={"ray.io/ft-enabled": "true"})) == [
        "the ray.io/ft-enabled or external-storage-namespace annotation beside gcsFaultToleranceOptions"]
    assert broken(lambda d, o, s: s["headGroupSpec"]["rayStartParams"].update({"redis-password": "x"})) == [
        "a redis-password / redis-username rayStartParam beside gcsFaultToleranceOptions"]
    assert broken(lambda d, o, s: s["gcsFaultToleranceOptions"].update(redisAddress="redis:6379")) == [
        "redisAddress redis:6379 is not the created Redis's Service (['tandem-redis:6379'])"]
    assert broken(lambda d, o, s: s["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]
                  .update(key="pw")) == ["tandem-redis: its password is not the Secret the head reads"]


def test_the_strict_crd_check_rejects_misspelt_and_mistyped_fields() -> None:
    validator = _crd_validator(MANIFESTS["rayservice.yaml"])
    manifest = load_kuberay("rayservice.yaml")
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("rayStartParam" in e for e in _errors(validator, bad))
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2
    assert _errors(validator, bad) != []
    bad = copy.deepcopy(manifest)
    bad["spec"]["serveConfigV2"] = yaml.safe_load(manifest["spec"]["serveConfigV2"])  # must be a string
    assert _errors(validator, bad) != []
    docs = kuberay_docs("rayservice.yaml")
    [redis] = [d for d in docs if d["kind"] == "StatefulSet"]
    redis["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    redis["spec"]["volumeClaimTemplates"][0]["spec"]["accessMode"] = ["ReadWriteOnce"]
    assert [e.split(": ")[-1] for e in _manifest_errors(docs)] == [
        "Additional properties are not allowed ('readinesProbe' was unexpected)",
        "Additional properties are not allowed ('accessMode' was unexpected)"]


def test_rayservice_serves_the_application_of_serve_config_yaml() -> None:
    from ray.serve.schema import ServeDeploySchema

    from tandem.router.app import build_app

    manifest = load_kuberay("rayservice.yaml")
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    base = load("serve_config.yaml")
    [app], [base_app] = served["applications"], base["applications"]
    assert {k: v for k, v in served.items() if k != "applications"} == \
           {k: v for k, v in base.items() if k != "applications"}
    assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in base_app.items() if k != "args"}
    # The layout the flags give, and device: cuda (GPU pods); the rest is serve_config.yaml's.
    set_keys = {"tensor_parallel_size", "pipeline_parallel_size", "num_replicas", "device"}
    assert {k: v for k, v in app["args"].items() if k not in set_keys} == \
           {k: v for k, v in base_app["args"].items() if k not in set_keys}
    assert app["args"]["device"] == "cuda"
    ServeDeploySchema.model_validate(served)
    build_app(app["args"])  # every argument known and valid


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_kuberay_manifest_is_its_generators_output(name: str) -> None:
    """deploy/kuberay/*.yaml are `tandem deploy kuberay` output: regenerate with the command
    their first line records and compare; a change to serve_config.yaml must be regenerated."""
    text = (DEPLOY / "kuberay" / name).read_text()
    command = re.match(r"# Generated by `tandem (deploy kuberay [^`]*)`", text)
    assert command, "the manifest's first line names the command that made it"
    regenerated = deploy_cli.render(deploy_cli.kuberay_options(build_parser().parse_args(shlex.split(command[1]))))
    assert text == regenerated, f"regenerate with: tandem {command.group(1)} -o deploy/kuberay/{name}"


def test_deploy_commands_run_from_any_directory(tmp_path) -> None:
    """The default Serve config is package data (tandem.deploy), not a path under the cwd."""

    def tandem(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tandem.cli.main", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    manifest = tandem("deploy", "kuberay", "--num-replicas", "2", "-tp", "2", "--gpus-per-node", "2")
    assert manifest == deploy_cli.render(deploy_cli.KubeRayOptions(layout=deploy_cli.Layout(2, 2, 1, 2)))
    [app] = yaml.safe_load(ray_object(list(yaml.safe_load_all(manifest)))["spec"]["serveConfigV2"])["applications"]
    assert (app["args"]["num_replicas"], app["args"]["device"]) == (2, "cuda")

    served = yaml.safe_load(tandem("deploy", "serve-config"))
    assert served == deploy_cli.with_app_args(load("serve_config.yaml"), {"device": "cuda"})
    assert served["applications"][0]["args"]["device"] == "cuda"
    assert list(tmp_path.iterdir()) == []  # nothing read or written where it ran


def test_the_readmes_kuberay_walk_through_matches_what_the_generator_writes() -> None:
    """deploy/README.md's steps name what its `tandem deploy kuberay` command writes: the Secret
    the Redis and the head read, the RayService, the Serve Service, the Redis's claim, the image."""
    text = (DEPLOY / "README.md").read_text()
    [command] = re.findall(r"(?m)^tandem deploy kuberay ((?:.*\\\n)*.*)$", text)
    args = build_parser().parse_args(["deploy", "kuberay", *shlex.split(command.replace("\\\n", " "))])
    options = deploy_cli.kuberay_options(args)
    docs = deploy_cli.documents(options)
    [service, redis, rayservice] = docs
    secret = cluster_spec(rayservice)["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]
    [create_secret] = [line.removeprefix("#").strip() for line in deploy_cli.render(options).splitlines()
                       if "kubectl create secret" in line]
    assert create_secret.startswith(f"kubectl create secret generic {secret['name']} --from-literal={secret['key']}=")
    assert f"\n{create_secret}\n" in text
    assert f"docker build -f deploy/Dockerfile -t {options.image} ." in text
    assert f"kubectl apply -f {args.output}\n" in text
    assert f"kubectl wait --for=condition=Ready rayservice/{rayservice['metadata']['name']} " in text
    serve = rayservice["spec"]["serveService"]
    ports = " ".join(f"{p['port']}:{p['port']}" for p in serve["spec"]["ports"])
    assert f"kubectl port-forward svc/{serve['metadata']['name']} {ports} &" in text
    claim = redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert f"kubectl delete pvc {claim}-{redis['metadata']['name']}-0 && kubectl delete secret {secret['name']}" in text
    assert service["metadata"]["name"] == redis["metadata"]["name"] == secret["name"] == "tandem-redis"
    assert '"model": "tandem-demo"' in text and options.model.model is None


# ---- the generator ------------------------------------------------------------------------------------
def test_layout_sizes_the_gpu_worker_group() -> None:
    layout = deploy_cli.Layout(num_replicas=3, tensor_parallel_size=2, pipeline_parallel_size=2, gpus_per_node=4,
                               spare_gpus=1)
    assert (layout.num_gpus, layout.num_worker_pods) == (13, 4)
    spec = deploy_cli.ray_cluster_spec(deploy_cli.KubeRayOptions(layout=layout), "2.60.0")
    [worker] = spec["workerGroupSpecs"]
    assert (worker["replicas"], worker["minReplicas"], worker["maxReplicas"], worker["rayStartParams"]) == (4, 4, 4, {
        "num-gpus": "4", "metrics-export-port": "8080", "dashboard-agent-listen-port": "52365",
        "dashboard-agent-grpc-port": "8078", "runtime-env-agent-port": "8079"})
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    with pytest.raises(ValueError, match="tensor_parallel_size=8 needs that many GPUs on one node"):
        deploy_cli.Layout(tensor_parallel_size=8, gpus_per_node=4)
    with pytest.raises(ValueError, match="num_replicas: must be at least 1"):
        deploy_cli.Layout(num_replicas=0)


def test_deploy_kuberay_command_writes_a_valid_manifest(tmp_path) -> None:
    from tandem.cli.main import main

    out = tmp_path / "svc.yaml"
    assert main(["deploy", "kuberay", "--num-replicas", "1", "-tp", "2", "-pp", "2", "--gpus-per-node", "2",
                 "--model", "/models/llama", "--name", "llm", "-o", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Service", "llm-redis"), ("StatefulSet", "llm-redis"), ("RayService", "llm")]
    manifest = ray_object(docs)
    [app] = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    assert {k: app["args"][k] for k in ("model", "tensor_parallel_size", "pipeline_parallel_size", "num_replicas")} \
        == {"model": "/models/llama", "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_replicas": 1}
    assert manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2
    if CRDS.is_dir():
        assert _manifest_errors(docs) == []
    assert rule_violations(docs) == []
    assert main(["deploy", "kuberay", "-tp", "4", "--gpus-per-node", "2"]) == 2  # refused, with the reason
    assert main(["deploy", "kuberay", "--redis-address", "redis:6379"]) == 2  # and a Redis without its password


# ---- the ports every node opens ------------------------------------------------------------------------
# Every node's agents on fixed ports: with port 0 the raylet waits ~15 s for each agent to write
# the port it took to a file, and on a loaded node that wait times out and the raylet crashes.
AGENT_PORTS = {"dashboard_agent_listen_port": 52365, "dashboard_agent_grpc_port": 8078,
               "runtime_env_agent_port": 8079, "metrics_export_port": 8080}


def _ray_start(args: list[str]) -> dict[str, Any]:
    """`ray start` arguments as Ray's own command parses them: an unknown flag or a bad value raises."""
    from ray.scripts.scripts import start

    return start.make_context("start", list(args)).params


def _launcher_ray_starts() -> list[tuple[str, dict[str, Any]]]:
    """(head_start_ray_commands or worker_start_ray_commands, its `ray start` parsed) in ray-cluster.yaml."""
    config = load("ray-cluster.yaml")
    starts = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in config[key]:
            for part in command.split(";"):
                words = shlex.split(part)
                at = [i for i in range(len(words) - 1) if words[i:i + 2] == ["ray", "start"]]
                starts += [(key, _ray_start(words[i + 2:])) for i in at]
    return starts


def _kuberay_ray_start(params: dict[str, str], head: bool) -> dict[str, Any]:
    """A group's rayStartParams as the `ray start` KubeRay runs: `--key=value`, "true" a bare flag."""
    args = ["--head"] if head else ["--address=tandem-head-svc:6379"]
    args += [f"--{key}" if value.lower() == "true" else f"--{key}={value}" for key, value in params.items()]
    return _ray_start(args)


def _kuberay_groups(manifest: dict[str, Any]) -> list[tuple[bool, dict[str, Any]]]:
    """(is the head, the group) of a RayService's or RayCluster's spec."""
    spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
    return [(True, spec["headGroupSpec"]), *[(False, group) for group in spec["workerGroupSpecs"]]]


def _node_ports(params: dict[str, Any], head: bool) -> dict[str, int]:
    """What a node listens on, by listener: Ray's components (given or `ray start`'s defaults; 0 or
    None is a free port Ray picks) and Serve's proxies (proxy_location EveryNode: on every node)."""
    serve = load("serve_config.yaml")
    assert serve["proxy_location"] == "EveryNode"
    ports = {name: params[name] for name in (*AGENT_PORTS, "object_manager_port", "node_manager_port")}
    if head:  # the GCS, the dashboard and the Ray client server run on the head only
        ports |= {"port": params["port"] or 6379, "dashboard_port": params["dashboard_port"],
                  "ray_client_server_port": params["ray_client_server_port"] or 10001}
    ports |= {"serve_http": serve["http_options"]["port"], "serve_grpc": serve["grpc_options"]["port"]}
    return {name: port for name, port in ports.items() if port}


def _assert_ports_fixed_and_apart(params: dict[str, Any], head: bool, where: str) -> None:
    assert {name: params[name] for name in AGENT_PORTS} == AGENT_PORTS, where
    ports = _node_ports(params, head)
    assert len(set(ports.values())) == len(ports), f"{where}: two listeners share a port: {ports}"
    workers = range(params["min_worker_port"], params["max_worker_port"] + 1)  # Ray's workers bind these
    assert [name for name, port in ports.items() if port in workers] == [], f"{where}: among Ray's worker ports"


def test_every_ray_start_of_the_launcher_fixes_the_agent_ports() -> None:
    starts = _launcher_ray_starts()
    assert [(key, params["head"]) for key, params in starts] == [("head_start_ray_commands", True),
                                                                ("worker_start_ray_commands", False)]
    for key, params in starts:
        _assert_ports_fixed_and_apart(params, params["head"], key)
        assert params["object_manager_port"] == 8076
    [(_, head)] = [start for start in starts if start[1]["head"]]
    assert (head["port"], head["dashboard_port"]) == (6379, 8265)


def test_the_readmes_ray_start_commands_fix_the_agent_ports() -> None:
    text = (DEPLOY / "README.md").read_text()
    [flags] = re.findall(r'(?m)^PORTS="([^"]*)"$', text)
    assert "ray start --head --port=6379 --dashboard-host=0.0.0.0 $PORTS" in text
    assert "ray start --address=HEAD_IP:6379 $PORTS" in text
    _assert_ports_fixed_and_apart(_ray_start(["--head", *shlex.split(flags)]), True, "deploy/README.md")


def test_every_kuberay_group_fixes_the_agent_ports() -> None:
    flags = ["--num-replicas", "3", "-tp", "4", "-pp", "2", "--gpus-per-node", "8", "--spare-gpus", "1"]
    manifests = {name: load_kuberay(name) for name in MANIFESTS} | {"generated": ray_object(generated(flags))}
    assert deploy_cli.node_port_params() == {"metrics-export-port": "8080", "dashboard-agent-listen-port": "52365",
                                             "dashboard-agent-grpc-port": "8078", "runtime-env-agent-port": "8079"}
    for name, manifest in manifests.items():
        for head, group in _kuberay_groups(manifest):
            where = f"{name}: {'head' if head else group['groupName']}"
            assert group["rayStartParams"].items() >= deploy_cli.node_port_params().items(), where
            params = _kuberay_ray_start(group["rayStartParams"], head)
            _assert_ports_fixed_and_apart(params, head, where)
            # The pod declares only ports its node opens, each once (the agents' need no declaring).
            [container] = group["template"]["spec"]["containers"]
            declared = [port["containerPort"] for port in container["ports"]]
            assert len(set(declared)) == len(declared), where
            assert set(declared) <= set(_node_ports(params, head).values()), where


def test_the_port_checks_catch_a_clash_and_a_misspelt_flag() -> None:
    import click

    fixed = ["--dashboard-agent-listen-port=52365", "--dashboard-agent-grpc-port=8078",
             "--runtime-env-agent-port=8079", "--metrics-export-port=8080"]
    _assert_ports_fixed_and_apart(_ray_start(["--head", *fixed]), True, "the fixed ports alone")
    with pytest.raises(AssertionError, match="two listeners share a port"):
        _assert_ports_fixed_and_apart(_ray_start(["--head", *fixed, "--dashboard-port=8078"]), True, "dashboard")
    with pytest.raises(AssertionError, match="among Ray's worker ports"):
        _assert_ports_fixed_and_apart(_ray_start([*fixed, "--min-worker-port=8000", "--max-worker-port=8100"]),
                                      False, "a worker")
    with pytest.raises(click.NoSuchOption):
        _kuberay_ray_start({"dashboard-agent-port": "8078"}, head=False)


def test_try_multi_node_script_parses() -> None:
    subprocess.run(["bash", "-n", str(DEPLOY / "try_multi_node.sh")], check=True)


def test_every_node_starts_with_haproxy_in_front_of_the_ingress() -> None:
    """Ray reads the proxy choice when a node starts: the image, the launcher's `ray start`
    commands, the KubeRay pods and the README's commands all set cluster/direct_ingress.py's."""
    from tandem.cluster.direct_ingress import NODE_ENV

    pairs = [f"{name}={value}" for name, value in NODE_ENV.items()]
    [env_line] = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENV ")]
    assert env_line.split()[1:] == pairs
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        [start] = [command for command in launcher[key] if "ray start" in command]
        assert f"export {' '.join(pairs)};" in start, key
    readme = (DEPLOY / "README.md").read_text()
    assert f"export {' '.join(pairs)}\n" in readme
    for name, (docs, _) in _checked_manifests().items():
        for _, group in _kuberay_groups(ray_object(docs)):
            [container] = group["template"]["spec"]["containers"]
            assert {e["name"]: e.get("value") for e in container["env"]}.items() >= NODE_ENV.items(), name


def test_the_image_copies_every_folder_the_package_installs_from() -> None:
    import tomllib

    folders = {path.split("/")[0] for path in
               tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()}
    copied = set(re.findall(r"(?m)^COPY --chown=\S+ (\w+) \1$", (DEPLOY / "Dockerfile").read_text()))
    assert sorted(folders - copied) == []
