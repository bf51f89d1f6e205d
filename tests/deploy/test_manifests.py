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
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.cli import deploy as deploy_cli
from tandem.cli.main import build_parser

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


def test_every_file_in_deploy_is_covered_here() -> None:
    files = sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file())
    # serve_config.yaml: tests/serve; grafana/tandem.json's queries: tests/serve/test_observability.py
    assert files == ["Dockerfile", "README.md", "grafana/tandem.json", "kuberay/raycluster.yaml",
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
    for name in ("kuberay/rayservice.yaml", "kuberay/raycluster.yaml"):
        manifest = load(name)
        spec = manifest["spec"]["rayClusterConfig"] if manifest["kind"] == "RayService" else manifest["spec"]
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
    assert "serve deploy /home/ray/tandem/deploy/serve_config.yaml" in config["head_start_ray_commands"][-1]


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
        manifest = load(f"kuberay/{name}")
        spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
        assert spec["rayVersion"] == ray


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


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_kuberay_manifest_passes_the_crd_schema(name: str) -> None:
    validator = _crd_validator(MANIFESTS[name])
    manifest = load(f"kuberay/{name}")
    assert manifest["apiVersion"] == "ray.io/v1"
    assert _errors(validator, manifest) == []
    spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        [container] = group["template"]["spec"]["containers"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    [worker] = spec["workerGroupSpecs"]
    gpus = worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == worker["rayStartParams"]["num-gpus"]


def test_the_strict_crd_check_rejects_misspelt_and_mistyped_fields() -> None:
    validator = _crd_validator(MANIFESTS["rayservice.yaml"])
    manifest = load("kuberay/rayservice.yaml")
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("rayStartParam" in e for e in _errors(validator, bad))
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2
    assert _errors(validator, bad) != []
    bad = copy.deepcopy(manifest)
    bad["spec"]["serveConfigV2"] = yaml.safe_load(manifest["spec"]["serveConfigV2"])  # must be a string
    assert _errors(validator, bad) != []


def test_rayservice_serves_the_application_of_serve_config_yaml() -> None:
    from ray.serve.schema import ServeDeploySchema

    from tandem.router.app import build_app

    manifest = load("kuberay/rayservice.yaml")
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    base = load("serve_config.yaml")
    [app], [base_app] = served["applications"], base["applications"]
    assert {k: v for k, v in served.items() if k != "applications"} == \
           {k: v for k, v in base.items() if k != "applications"}
    assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in base_app.items() if k != "args"}
    layout_keys = {"tensor_parallel_size", "pipeline_parallel_size", "num_replicas"}
    assert {k: v for k, v in app["args"].items() if k not in layout_keys} == \
           {k: v for k, v in base_app["args"].items() if k not in layout_keys}
    ServeDeploySchema.model_validate(served)
    build_app(app["args"])  # every argument known and valid


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_kuberay_manifest_is_its_generators_output(name: str, monkeypatch) -> None:
    """deploy/kuberay/*.yaml are `tandem deploy kuberay` output: regenerate with the command
    their first line records and compare; a change to serve_config.yaml must be regenerated."""
    monkeypatch.chdir(ROOT)
    text = (DEPLOY / "kuberay" / name).read_text()
    command = re.match(r"# Generated by `tandem (deploy kuberay [^`]*)`", text)
    assert command, "the manifest's first line names the command that made it"
    args = build_parser().parse_args(shlex.split(command.group(1)))
    layout = deploy_cli.Layout(args.num_replicas, args.tensor_parallel_size, args.pipeline_parallel_size,
                               args.gpus_per_node, args.spare_gpus, args.model)
    regenerated = deploy_cli.render(args.kind, layout, config_path=args.config, image=args.image, name=args.name)
    assert text == regenerated, f"regenerate with: tandem {command.group(1)} -o deploy/kuberay/{name}"


# ---- the generator ------------------------------------------------------------------------------------
def test_layout_sizes_the_gpu_worker_group() -> None:
    layout = deploy_cli.Layout(num_replicas=3, tensor_parallel_size=2, pipeline_parallel_size=2, gpus_per_node=4,
                               spare_gpus=1)
    assert (layout.num_gpus, layout.num_worker_pods) == (13, 4)
    spec = deploy_cli.ray_cluster_spec(layout, "img", "2.60.0")
    [worker] = spec["workerGroupSpecs"]
    assert (worker["replicas"], worker["rayStartParams"]) == (4, {
        "num-gpus": "4", "metrics-export-port": "8080", "dashboard-agent-listen-port": "52365",
        "dashboard-agent-grpc-port": "8078", "runtime-env-agent-port": "8079"})
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    with pytest.raises(ValueError, match="tensor_parallel_size=8 needs that many GPUs on one node"):
        deploy_cli.Layout(tensor_parallel_size=8, gpus_per_node=4)
    with pytest.raises(ValueError, match="num_replicas: must be at least 1"):
        deploy_cli.Layout(num_replicas=0)


def test_deploy_kuberay_command_writes_a_valid_manifest(tmp_path, monkeypatch) -> None:
    from tandem.cli.main import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "svc.yaml"
    assert main(["deploy", "kuberay", "--num-replicas", "1", "-tp", "2", "-pp", "2", "--gpus-per-node", "2",
                 "--model", "/models/llama", "--name", "llm", "-o", str(out)]) == 0
    manifest = yaml.safe_load(out.read_text())
    assert manifest["metadata"]["name"] == "llm"
    [app] = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    assert {k: app["args"][k] for k in ("model", "tensor_parallel_size", "pipeline_parallel_size", "num_replicas")} \
        == {"model": "/models/llama", "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_replicas": 1}
    assert manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2
    if CRDS.is_dir():
        assert _errors(_crd_validator(MANIFESTS["rayservice.yaml"]), manifest) == []
    assert main(["deploy", "kuberay", "-tp", "4", "--gpus-per-node", "2"]) == 2  # refused, with the reason


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
    generated = deploy_cli.render("rayservice", deploy_cli.Layout(3, 4, 2, gpus_per_node=8, spare_gpus=1),
                                  config_path=str(DEPLOY / "serve_config.yaml"))
    manifests = {name: load(f"kuberay/{name}") for name in MANIFESTS} | {"generated": yaml.safe_load(generated)}
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
    for name in MANIFESTS:
        for _, group in _kuberay_groups(load(f"kuberay/{name}")):
            [container] = group["template"]["spec"]["containers"]
            assert {e["name"]: e["value"] for e in container["env"]} == NODE_ENV, name
