"""Metrics and traces of a real deployment: the demo model served by Ray Serve, scraped by a real
Prometheus server (Debian's `prometheus`; skipped where it is not installed), traces written by
the console exporter to a file (one JSON line per span, from every Ray process).

One Ray + Serve instance for the module, with Ray's metrics pushed every second and tracing on
through the standard OTEL_* variables (set before Ray starts, so every worker inherits them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import yaml

from tandem.cluster.local_ray import start_local_ray, stop_local_ray
from tandem.cluster.net import free_port
from tests.conftest import wait_for

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

APP_NAME = "tandem"
MODEL = "tandem-demo"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE_HTTP = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_GRPC = "0af7651916cd43dd8448eb211c80319c"
TRACE_STREAM = "5c2d8e1f0a9b4c3d8e7f6a5b4c3d2e1f"
CLIENT_SPAN = "00f067aa0ba902b7"
ENV = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "tandem-test"}


def _get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[dict, dict[str, str]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read()), {k.lower(): v for k, v in reply.headers.items()}


class Deployment:
    def __init__(self, base_url: str, grpc_port: int, metrics_port: int, traces: str, workdir: str) -> None:
        self.base_url = base_url
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.traces = traces
        self.workdir = workdir
        self.num_group_requests = 0  # every request that reached a group (each is one TTFT observation)
        self.prometheus: subprocess.Popen | None = None
        self.prometheus_url = ""

    def complete(self, prompt: str, headers: dict[str, str] | None = None, max_tokens: int = 4) -> tuple[dict, dict]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        reply = _post(self.base_url + "/v1/completions", body, headers or {})
        self.num_group_requests += 1
        return reply

    def spans(self) -> list[dict]:
        if not os.path.exists(self.traces):
            return []
        with open(self.traces) as f:
            return [json.loads(line) for line in f if line.strip()]

    def query(self, expr: str) -> list[dict]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        reply = _get_json(url)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]


def _start_prometheus(dep: Deployment) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        return
    port = free_port()
    config = os.path.join(dep.workdir, "prometheus.yml")
    # The shipped scrape job's relabelling (vLLM's names: ray_vllm_* -> vllm:*), this deployment's target.
    with open(os.path.join(ROOT, "deploy", "prometheus.yml")) as f:
        (shipped,) = yaml.safe_load(f)["scrape_configs"]
    job = {"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{dep.metrics_port}"]}],
           "metric_relabel_configs": shipped["metric_relabel_configs"]}
    with open(config, "w") as f:
        yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [job]}, f)
    log = open(os.path.join(dep.workdir, "prometheus.log"), "w")  # noqa: SIM115 - closed with the process
    dep.prometheus = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={dep.workdir}/tsdb",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    dep.prometheus_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(dep.prometheus_url + "/-/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    assert wait_for(ready, timeout_s=30), "prometheus did not become ready"


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from tandem.cli.serve import GRPC_SERVICER
    from tandem.router.app import build_app

    workdir = tempfile.mkdtemp(prefix="tandem-observability-")
    traces = os.path.join(workdir, "spans.jsonl")
    saved = {k: os.environ.get(k) for k in (*ENV, "TANDEM_TRACES_FILE")}
    os.environ.update(ENV, TANDEM_TRACES_FILE=traces)
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    start_local_ray(address="local", num_cpus=8, include_dashboard=False, _metrics_export_port=metrics_port,
                    _system_config={"metrics_report_interval_ms": 1000})
    dep = Deployment(f"http://127.0.0.1:{http_port}", grpc_port, metrics_port, traces, workdir)
    try:
        _start_prometheus(dep)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
        serve.run(build_app({"group_num_cpus": 1, "metrics_interval_s": 0.5}), name=APP_NAME, route_prefix="/")
        yield dep
    finally:
        if dep.prometheus is not None:
            dep.prometheus.terminate()
            dep.prometheus.wait(timeout=30)
        serve.shutdown()
        stop_local_ray()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(workdir, ignore_errors=True)


def _trace(dep: Deployment, trace_id: str, names: set[str]) -> dict[str, dict]:
    """The spans of one trace, by name, once all of `names` are there (exporters batch)."""
    def found() -> dict[str, dict]:
        spans = {s["name"]: s for s in dep.spans() if s["context"]["trace_id"] == "0x" + trace_id}
        return spans if names <= set(spans) else {}

    spans = wait_for(found, timeout_s=30, interval_s=0.2)
    assert spans, f"spans {sorted(names)} of trace {trace_id} never all arrived: {dep.spans()}"
    return spans


def _check_connected(spans: dict[str, dict], ingress: str) -> None:
    ids = {s["context"]["span_id"]: name for name, s in spans.items()}
    assert spans[ingress]["parent_id"] == "0x" + CLIENT_SPAN  # under the client's span
    parents = {name: ids.get(s["parent_id"]) for name, s in spans.items() if name != ingress}
    assert parents == {"route": ingress, "group_request": ingress, "queue": "group_request",
                       "prefill": "group_request", "decode": "group_request"}


GROUP_SPANS = {"route", "group_request", "queue", "prefill", "decode"}


def test_http_request_is_one_connected_trace(deployment: Deployment) -> None:
    traceparent = f"00-{TRACE_HTTP}-{CLIENT_SPAN}-01"
    body, headers = deployment.complete("Hello, tandem", {"traceparent": traceparent, "x-request-id": "req-http-1"})
    assert headers["x-request-id"] == "req-http-1"
    ingress = f"text_completion {MODEL}"  # {gen_ai.operation.name} {gen_ai.request.model}
    spans = _trace(deployment, TRACE_HTTP, GROUP_SPANS | {ingress})
    _check_connected(spans, ingress)
    attrs = spans[ingress]["attributes"]
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.provider.name"] == "tandem"
    assert (attrs["http.request.method"], attrs["url.path"]) == ("POST", "/v1/completions")
    assert attrs["gen_ai.request.id"] == "req-http-1"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 4
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.id"] == body["id"] + "-0"  # the first prompt's group request
    group = spans["group_request"]
    assert group["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert group["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert [e["name"] for e in group["events"]] == ["first_token", "finish"]
    assert [e["name"] for e in spans["decode"]["events"]] == ["first_token"]
    assert spans["prefill"]["attributes"]["tandem.prefill.num_chunks"] == 1
    assert spans["route"]["attributes"]["tandem.route.decision"] in ("prefix", "load")
    assert spans["route"]["attributes"]["tandem.route.replica_group"] == group["attributes"]["tandem.replica_group"]


def test_a_streamed_request_sent_on_the_channel_is_one_connected_trace(deployment: Deployment) -> None:
    """With one group, a streamed request goes on the ingress's channel to it (no Serve call, no
    request router): the ingress records the route span itself."""
    import requests

    body = {"model": MODEL, "prompt": "Hello, tandem", "max_tokens": 32, "temperature": 0, "stream": True}
    url = deployment.base_url + "/v1/completions"
    with requests.post(url, json=body, stream=True, timeout=60) as holder:  # its call opens the channel
        lines = holder.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: {"))
        traceparent = f"00-{TRACE_STREAM}-{CLIENT_SPAN}-01"
        with requests.post(url, json={**body, "max_tokens": 4}, headers={"traceparent": traceparent},
                           stream=True, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        list(lines)
    deployment.num_group_requests += 2
    ingress = f"text_completion {MODEL}"
    spans = _trace(deployment, TRACE_STREAM, GROUP_SPANS | {ingress})
    _check_connected(spans, ingress)
    route = spans["route"]["attributes"]
    assert (route["tandem.route.decision"], route["tandem.route.num_candidates"]) == ("only_group", 1)
    assert route["tandem.route.replica_group"] == spans["group_request"]["attributes"]["tandem.replica_group"]


def test_grpc_request_is_one_connected_trace(deployment: Deployment) -> None:
    from tandem.router import tandem_pb2 as pb
    from tandem.router import tandem_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{deployment.grpc_port}") as channel:
        stub = pb_grpc.TandemStub(channel)
        request = pb.GenerateRequest(model=MODEL, text="Hello over gRPC", sampling=pb.SamplingParams(
            max_tokens=3, temperature=0.0))
        metadata = (("traceparent", f"00-{TRACE_GRPC}-{CLIENT_SPAN}-01"),)
        reply, call = stub.Generate.with_call(request, metadata=metadata, timeout=60)
    deployment.num_group_requests += 1
    trailing = dict(call.trailing_metadata())
    assert trailing["x-request-id"] == trailing["request_id"]
    ingress = f"text_completion {MODEL}"
    spans = _trace(deployment, TRACE_GRPC, GROUP_SPANS | {ingress})
    _check_connected(spans, ingress)
    attrs = spans[ingress]["attributes"]
    assert (attrs["rpc.system"], attrs["rpc.method"], attrs["gen_ai.request.model"]) == ("grpc", "Generate", MODEL)
    assert attrs["gen_ai.provider.name"] == "tandem"
    assert attrs["gen_ai.request.id"] == trailing["request_id"]
    assert attrs["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens == 3
    assert attrs["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens


def _value(result: list[dict]) -> float:
    return sum(float(r["value"][1]) for r in result)


def _grafana_exprs() -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "deploy", "grafana", "tandem.json")) as f:
        dashboard = json.load(f)
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_prometheus_scrapes_the_deployment(deployment: Deployment) -> None:
    if deployment.prometheus is None:
        pytest.skip("no `prometheus` binary (apt-get install prometheus; .ci/run installs it): "
                    "the real-Prometheus test cannot run here")
    for i in range(3):
        deployment.complete(f"prompt number {i} for the scrape", max_tokens=5)
    sent = deployment.num_group_requests
    ttft = "sum(ray_tandem_time_to_first_token_seconds_count)"
    assert wait_for(lambda: _value(deployment.query(ttft)) == sent, timeout_s=30), deployment.query(ttft)
    tokens = "sum(ray_tandem_generation_tokens_total)"
    assert wait_for(lambda: _value(deployment.query(tokens)) >= 3 * 5, timeout_s=30)
    kv = 'max(ray_tandem_kv_cache_usage_perc{application="tandem"})'
    assert wait_for(lambda: deployment.query(kv) and _value(deployment.query(kv)) == 0.0, timeout_s=30)
    _check_vllm_names(deployment, sent)
    # Every panel's query returns a series (variables as Grafana would fill them for "All").
    missing = []
    for title, expr in _grafana_exprs():
        concrete = expr.replace("$application", ".*").replace("$model_name", ".*").replace("$__rate_interval", "1m")
        if not wait_for(lambda concrete=concrete: deployment.query(concrete), timeout_s=10):
            missing.append(f"{title}: {concrete}")
    assert missing == []
    finished = deployment.query('sum by (finished_reason) (ray_tandem_requests_finished_total)')
    assert {r["metric"]["finished_reason"]: float(r["value"][1]) for r in finished}["length"] == sent
    mbu = deployment.query("ray_tandem_model_bandwidth_utilization")
    assert mbu and all(float(r["value"][1]) >= 0.0 for r in mbu)


# vLLM's series (workers/serving/vllm_metrics.py) as Prometheus stores them after deploy/prometheus.yml's rule.
VLLM_GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc"]
VLLM_COUNTERS = ["prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "request_success"]
VLLM_HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
                   "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                   "request_prompt_tokens", "request_generation_tokens"]
VLLM_SERIES = {*(f"vllm:{g}" for g in VLLM_GAUGES), *(f"vllm:{c}_total" for c in VLLM_COUNTERS),
               *(f"vllm:{h}_{part}" for h in VLLM_HISTOGRAMS for part in ("bucket", "sum", "count"))}


def _check_vllm_names(dep: Deployment, sent: int) -> None:
    """Every vLLM-named series, labelled as vLLM labels them, none left under Ray's name."""
    def names() -> set[str]:
        return {r["metric"]["__name__"] for r in dep.query('{__name__=~"vllm:.+"}')}

    assert wait_for(lambda: names() == VLLM_SERIES, timeout_s=30), sorted(names() ^ VLLM_SERIES)
    assert dep.query('{__name__=~"ray_vllm_.+"}') == []
    ttft = f'sum(vllm:time_to_first_token_seconds_count{{model_name="{MODEL}"}})'
    assert wait_for(lambda: _value(dep.query(ttft)) == sent, timeout_s=30), dep.query(ttft)
    def finished() -> dict[str, float]:
        by_reason = f'sum by (finished_reason) (vllm:request_success_total{{model_name="{MODEL}"}})'
        return {r["metric"]["finished_reason"]: float(r["value"][1]) for r in dep.query(by_reason)}

    expected = {"stop": 0.0, "length": sent, "abort": 0.0, "error": 0.0}
    assert wait_for(lambda: finished() == expected, timeout_s=30), finished()
    # model_name: the served model; engine: the replica group (tandem's replica_group label).
    labels = {(r["metric"]["model_name"], r["metric"]["engine"], r["metric"]["application"])
              for r in dep.query('{__name__=~"vllm:.+"}')}
    groups = {r["metric"]["replica_group"] for r in dep.query("ray_tandem_num_requests_running")}
    assert labels == {(MODEL, group, APP_NAME) for group in groups}


def test_the_telemetry_codes_own_cost_runs_the_real_code(deployment: Deployment) -> None:
    """`tandem bench observability`'s measure of the metrics and tracing code: every span a
    served request makes is exported, and tracing is back to the environment's after."""
    from tandem.router.telemetry_cost import telemetry_cpu_cost
    from tandem.workers.serving import tracer

    cost = telemetry_cpu_cost(num_requests=20, steps_per_report=10)
    assert cost["telemetry_spans_per_request"] == 6.0  # ingress, route, group_request, queue, prefill, decode
    assert cost["telemetry_cpu_s_per_request"] > 0 and cost["telemetry_cpu_s_per_report"] > 0
    assert tracer.tracer() is not None  # this module's environment turns tracing on
