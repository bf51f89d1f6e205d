"""tandem across two Ray nodes started the way an operator starts them.

A head (`ray start --head`) and a second node (`ray start --address=...`), each its own
raylet with a slice of the logical CPUs, run the application of deploy/serve_config.yaml,
deployed with `serve deploy` through the head's dashboard. Two PP=2 replica groups; custom
resources place them so that

    head:    group A (engine, stage 0, stage 1)    + stage 1 of group B
    worker:  group B's engine and stage 0

i.e. the groups' engines on different nodes and group B's stages spanning both. Then: the
OpenAI and gRPC clients get the offline engine's greedy output from both groups; stopping
the second node mid-stream ends its requests with a clean error while group A serves on;
a node that joins again gets a new group B; and `tandem serve --address auto` joins the
running cluster. deploy/try_multi_node.sh does the same steps by hand.
"""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
import yaml

from tandem.cli import deploy as deploy_cli
from tandem.cluster.net import free_port
from tandem.router import tandem_pb2 as pb
from tandem.router import tandem_pb2_grpc as pb_grpc
from tests.conftest import wait_for
from tests.deploy import cluster_probe
from tests.deploy.ray_nodes import RayNode, cluster_env, serve_cmd, start_head, start_node

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tandem-demo"
HEAD_RESOURCES = {"tandem_head": 100, "group_slot": 1, "stage0": 1, "stage1": 2}
WORKER_RESOURCES = {"group_slot": 1, "stage0": 1}
# Bundle 0 holds a group's engine (one per node: group_slot), then stage 0, then stage 1.
# PACK puts the first group wholly on the head (the only node that can hold it all); the
# second takes the worker's slot and stage 0, and the head's other stage 1.
GROUP_BUNDLES = [{"CPU": 1, "group_slot": 1}, {"CPU": 1, "stage0": 1}, {"CPU": 1, "stage1": 1}]
MAX_TOKENS = 24
LONG = 256  # offline reference length for streams read only in part
ENDLESS = 1700  # a stream still running a few steps of the test later (with the prompt, the demo model's 2048)


def prompt(seed: int) -> list[int]:
    """320 token ids: 20 full KV blocks, which prefix routing values above one request of
    load (`routing_tokens_per_request` 256), so a prompt goes back to its group even when
    that group carries one stream more than the other."""
    return [10 + (seed * 997 + i * 131) % 4000 for i in range(320)]


@dataclass
class Cluster:
    base: Path
    env: dict[str, str]
    gcs: str
    dashboard: str
    head: RayNode
    workers: list[RayNode]
    http: str = ""
    grpc_target: str = ""
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # the last probe
    served_by: dict[int, str] = field(default_factory=dict)  # prompt seed -> group id
    started: list[RayNode] = field(default_factory=list)  # what the fixture stops at the end
    prober: subprocess.Popen | None = None  # tests/deploy/cluster_probe.py, started on first use
    replies: queue.Queue = field(default_factory=queue.Queue)  # the probe's stdout lines; None at its end

    def join(self, name: str) -> RayNode:
        """A new worker node joined to the head (stopped with the cluster)."""
        node = start_node(self.base, name, self.env, head_address=self.gcs, num_cpus=2, resources=WORKER_RESOURCES,
                          diagnose=self.head)
        self.started.append(node)
        self.workers.append(node)
        return node

    def run(self, *cmd: str, timeout_s: float = 120) -> str:
        out = subprocess.run(list(cmd), env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        assert out.returncode == 0, f"{cmd[-3:]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The probe's reply to `request` (see tests/deploy/cluster_probe.py)."""
        if self.prober is None:
            with open(self.base / "probe.log", "w") as log:
                self.prober = subprocess.Popen(
                    [sys.executable, "-m", "tests.deploy.cluster_probe", self.gcs, self.dashboard], env=self.env,
                    cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            # A thread reads the replies, so a wait for one can time out.
            threading.Thread(target=_read_lines, args=(self.prober.stdout, self.replies), daemon=True).start()
        self.prober.stdin.write(json.dumps(request) + "\n")
        self.prober.stdin.flush()
        deadline = time.monotonic() + timeout_s
        try:
            while (line := self.replies.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
                if line.startswith(cluster_probe.REPLY_PREFIX):
                    return json.loads(line.removeprefix(cluster_probe.REPLY_PREFIX))
        except queue.Empty:
            pass
        log = (self.base / "probe.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"no reply from the probe to {request} (exit code {self.prober.poll()}):\n{log}")

    def stop_prober(self) -> None:
        if self.prober is not None:
            self.prober.stdin.close()  # the probe's cue to shut its driver down
            try:
                self.prober.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.prober.kill()
                self.prober.wait()

    def snapshot(self, group: str) -> dict[str, Any]:
        """`group` as it is now (no waiting for the groups to settle): what it is running. On a
        loaded machine the group's stats call can time out; it is asked again."""
        for _ in range(5):
            seen = self.ask({"group": group}, timeout_s=60)
            if seen["error"] is None:
                return seen
            time.sleep(1.0)
        raise AssertionError(f"group {group} did not answer five probes; the last: {seen['error']}")

    def probe(self, num_groups: int, timeout_s: float = 180) -> dict[str, dict[str, Any]]:
        result = self.ask({"num_groups": num_groups, "timeout_s": timeout_s}, timeout_s=timeout_s + 60)
        assert not result["timed_out"], result
        self.groups = result["groups"]
        return self.groups

    def group_on(self, head: bool) -> str:
        [group] = [g for g, info in self.groups.items() if info["on_head"] == head]
        return group


@pytest.fixture(scope="module")
def offline() -> dict[tuple[int, int], str]:
    """(prompt seed, max_tokens) -> the offline engine's greedy text."""
    from tandem.workers import LLM, SamplingParams

    llm = LLM()
    wanted = [(seed, MAX_TOKENS) for seed in range(12)] + [(seed, LONG) for seed in (0, 1, 2, 5, 8, 9)]
    outs = llm.generate([{"prompt_token_ids": prompt(s)} for s, _ in wanted],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in wanted])
    llm.shutdown()
    return {key: out.outputs[0].text for key, out in zip(wanted, outs, strict=True)}


@pytest.fixture(scope="module")
def cluster(offline) -> Cluster:
    base = Path(tempfile.mkdtemp(prefix="tdm-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = cluster_env()
    nodes: list[RayNode] = []  # every node started, the tests' own included: all stopped at the end
    cluster = None
    try:
        head, gcs, dashboard = start_head(base, env, num_cpus=6, resources=HEAD_RESOURCES)
        nodes.append(head)
        nodes.append(start_node(base, "worker1", env, head_address=gcs, num_cpus=2, resources=WORKER_RESOURCES))
        cluster = Cluster(base, env, gcs, dashboard, head, nodes[1:], started=nodes)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop_prober()
        for node in reversed(nodes):
            node.stop()  # a no-op for a node a test stopped already
        shutil.rmtree(base, ignore_errors=True)


def multi_node_config(http_port: int, grpc_port: int) -> dict[str, Any]:
    """deploy/serve_config.yaml with two PP=2 groups, placed by the custom resources above."""
    layout = deploy_cli.Layout(num_replicas=2, pipeline_parallel_size=2)
    config = deploy_cli.serve_config(deploy_cli.load_serve_config(ROOT / deploy_cli.DEFAULT_CONFIG), layout)
    config["proxy_location"] = "HeadOnly"  # the client's connection must not die with the worker
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    [app] = config["applications"]
    app["deployments"] = [
        {"name": "OpenAIIngress", "ray_actor_options": {"num_cpus": 0, "resources": {"tandem_head": 1}}},
        {"name": "GroupServer", "placement_group_bundles": GROUP_BUNDLES, "placement_group_strategy": "PACK"},
    ]
    return config


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def openai_client(cluster: Cluster):
    from openai import OpenAI

    return OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", max_retries=0, timeout=60)


def open_stream(client, seed: int, max_tokens: int):
    """A streamed completion, its group and its first chunk's text (it is routed and running)."""
    stream = client.completions.create(model=MODEL, prompt=prompt(seed), max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    group = stream.response.headers["x-tandem-groups"]
    first = next(iter(stream)).choices[0].text
    return stream, group, first


def head_of(stream, first: str, seed: int, offline) -> None:
    """Read a long stream until it holds as much text as MAX_TOKENS tokens of the offline
    output, check it is the offline output's beginning, and close it (the group aborts it)."""
    text = first
    for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if len(text) >= len(offline[seed, MAX_TOKENS]):
            break
    stream.close()
    assert len(text) >= len(offline[seed, MAX_TOKENS]) and offline[seed, LONG].startswith(text)


def rest(stream) -> str:
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def complete_on_another_group(client, busy: str, seeds: tuple[int, ...], offline) -> tuple[str, int, int]:
    """(group, seed, requests sent): a completion opened while group `busy` streams goes to
    another (idle) group. On a loaded machine Serve may not hear the idle group's queue
    length in time and fall back to `busy`; that answer is checked too, and the next seed
    (a fresh prompt, no prefix credit anywhere) goes again."""
    for num_sent, seed in enumerate(seeds, start=1):
        stream, group, first = open_stream(client, seed, MAX_TOKENS)
        assert first + rest(stream) == offline[seed, MAX_TOKENS]
        if group != busy:
            return group, seed, num_sent
    raise AssertionError(f"{len(seeds)} completions opened beside a stream on {busy} all went to it")


def open_stream_on(cluster: Cluster, client, seed: int, max_tokens: int, group: str,
                   idle: bool) -> tuple[Any, str]:
    """A streamed completion of a prompt that `group` holds, routed there: (the stream, its first
    text). The router scores groups on load reports polled about once a second
    (`routing_stats_period_s`), and Serve gives the first-ranked group a deadline to report
    its queue; on a loaded 2-core machine a late report or a missed deadline sends the prompt
    to the other group now and then. Such a stream is closed (the group aborts it) and the
    prompt sent again once the groups have been polled: up to three times. `idle`: every group
    should be idle first (a probe waits for it), as it is when no other stream is open."""
    for attempt in range(3):
        if idle:
            cluster.probe(num_groups=len(cluster.groups))
        if idle or attempt:
            time.sleep(3.0)
        stream, routed, first = open_stream(client, seed, max_tokens)
        if routed == group:
            return stream, first
        stream.close()
    raise AssertionError(f"three streams of a prompt that {group} holds all went to {routed}")


def streams_across_the_stop(cluster: Cluster, client, stub, seed_a: int, seed_b: int) -> tuple[Any, str, Any, Any]:
    """Three ENDLESS streams, all just opened: (the survivor, an HTTP stream on the head's group,
    and its first text; the doomed HTTP stream and the doomed gRPC response iterator, both on the
    worker's group). `seed_a` / `seed_b`: a prompt the head's / the worker's group holds.

    The order makes the gRPC stream's routing a matter of scores, not of timing: the survivor
    goes to the head's group for its prefix; the doomed HTTP stream to the worker's, for its
    prefix and the lighter load; then the gRPC stream finds one stream on each group, and the
    worker's group's prefix credit sends it there. Should an earlier stream routed astray have
    left the prompt on the head's group too, the credits tie and the head's fuller KV cache (its
    stream is the older) still ranks it second. gRPC responses do not name their group, so the
    worker group's running count (a probe) says where it went. Where it went elsewhere (Serve
    missed the first-ranked group's queue-length deadline), all three are closed and opened
    again, up to three times: an ENDLESS stream lasts only some seconds on an idle machine."""
    on_head, on_worker = cluster.group_on(head=True), cluster.group_on(head=False)
    for _ in range(3):
        survivor, first = open_stream_on(cluster, client, seed_a, ENDLESS, on_head, idle=True)
        doomed, _ = open_stream_on(cluster, client, seed_b, ENDLESS, on_worker, idle=False)
        time.sleep(2.5)  # two load polls (`routing_stats_period_s`): the router's view holds both streams
        responses, _, _ = grpc_stream(stub, seed_b, ENDLESS)
        if cluster.snapshot(on_worker)["num_running"] == 2:
            return survivor, first, doomed, responses
        responses.cancel()
        doomed.close()
        survivor.close()
    raise AssertionError(f"three gRPC streams of a prompt that {on_worker} holds went elsewhere")


def grpc_stream(stub, seed: int, max_tokens: int):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(seed)), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    responses = stub.GenerateStream(request, timeout=120)
    first = next(responses)
    return responses, list(first.choices[0].token_ids), first.choices[0].text


# ---- the run, in order ------------------------------------------------------------------------------
def test_serve_deploy_places_two_groups_on_two_nodes(cluster: Cluster) -> None:
    http_port, grpc_port = free_port(), free_port()
    path = cluster.base / "serve_config.yaml"
    path.write_text(yaml.safe_dump(multi_node_config(http_port, grpc_port), sort_keys=False))
    cluster.run(*serve_cmd("deploy", str(path), "--address", cluster.dashboard))
    cluster.http, cluster.grpc_target = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"

    groups = cluster.probe(num_groups=2)
    # Group A wholly on the head; group B's engine and stage 0 on the worker, stage 1 on the head.
    assert sorted((info["on_head"], info["bundles_on_head"]) for info in groups.values()) == [
        (False, [False, False, True]), (True, [True, True, True])]
    assert all(info["num_requests_total"] == 0 for info in groups.values())
    assert wait_for(lambda: _health(cluster) == 200, timeout_s=60, interval_s=0.5)


def test_openai_and_grpc_clients_get_offline_output_from_both_groups(cluster: Cluster, offline) -> None:
    client = openai_client(cluster)
    # A second request opened while the first runs goes to the other (idle) group.
    s0, g0, t0 = open_stream(client, 0, ENDLESS)
    g1, seed1, num_http = complete_on_another_group(client, g0, (1, 8, 9), offline)
    assert {g0, g1} == set(cluster.groups)
    head_of(s0, t0, 0, offline)
    cluster.served_by.update({0: g0, seed1: g1})

    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.TandemStub(channel)
        r2, ids2, text2 = grpc_stream(stub, 2, ENDLESS)
        r3, ids3, text3 = grpc_stream(stub, 3, MAX_TOKENS)
        for message in r3:
            ids3 += message.choices[0].token_ids
            text3 += message.choices[0].text
        assert len(ids3) == MAX_TOKENS and text3 == offline[3, MAX_TOKENS]
        for message in r2:
            ids2 += message.choices[0].token_ids
            text2 += message.choices[0].text
            if len(ids2) >= MAX_TOKENS:
                break
        r2.cancel()
        assert offline[2, LONG].startswith(text2) and len(text2) >= len(offline[2, MAX_TOKENS])
    # The HTTP streams reached both groups; the gRPC ones go where the router's load reports
    # (a second apart) put them, which may be the same group twice.
    groups = cluster.probe(num_groups=2)
    served = {g: info["num_requests_total"] for g, info in groups.items()}
    assert sum(served.values()) == 1 + num_http + 2 and min(served.values()) >= 1, served


def test_stopping_a_node_mid_stream_fails_its_requests_cleanly(cluster: Cluster, offline) -> None:
    from openai import APIError

    on_head, on_worker = cluster.group_on(head=True), cluster.group_on(head=False)
    seed_a = next(s for s, g in cluster.served_by.items() if g == on_head)
    seed_b = next(s for s, g in cluster.served_by.items() if g == on_worker)
    client = openai_client(cluster)
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        survivor, first, doomed, doomed_grpc = streams_across_the_stop(
            cluster, client, pb_grpc.TandemStub(channel), seed_a, seed_b)

        cluster.workers.pop().stop()

        with pytest.raises(APIError, match="service unavailable"):
            rest(doomed)
        with pytest.raises(grpc.RpcError) as info:
            list(doomed_grpc)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    head_of(survivor, first, seed_a, offline)  # still streaming the offline output

    # Group A alone now, with every KV block free again; it keeps answering.
    groups = cluster.probe(num_groups=1)
    assert list(groups) == [on_head]
    reply = client.completions.with_raw_response.create(model=MODEL, prompt=prompt(4), max_tokens=MAX_TOKENS,
                                                        temperature=0, extra_body={"ignore_eos": True})
    assert reply.headers["x-tandem-groups"] == on_head
    assert reply.parse().choices[0].text == offline[4, MAX_TOKENS]


def test_a_node_that_joins_again_gets_a_new_group(cluster: Cluster, offline) -> None:
    survivor = cluster.group_on(head=True)
    # A `ray start` on a loaded 2-core machine can crash its raylet: Ray 2.60 gives the new
    # node's dashboard agent 15 s to start, and just after the last test stopped a node the
    # machine is busy (Serve retrying the lost group). An operator would start the node
    # again, and what is under test is Serve placing a group on it: up to four starts, a
    # pause between them for the load to pass. A failed start's stacks and logs are in the error.
    for attempt in range(4):
        name = f"worker{2 + attempt}"
        try:
            cluster.join(name)
            break
        except RuntimeError as error:
            if attempt == 3:
                raise
            # A warning, not a print: pytest's summary shows it even when a later start works.
            warnings.warn(f"ray start {name} failed; starting the node again. {error}", stacklevel=1)
            time.sleep(15.0)
    # Serve starts the new group (two processes, imports, a model load) on a machine its three
    # nodes share: minutes under a full suite's load. A timeout says what Serve was waiting for.
    groups = cluster.probe(num_groups=2, timeout_s=420)
    new = cluster.group_on(head=False)
    assert survivor in groups and new != survivor

    client = openai_client(cluster)
    s5, g5, t5 = open_stream(client, 5, ENDLESS)
    g6, _, _ = complete_on_another_group(client, g5, (6, 10, 11), offline)
    assert {g5, g6} == {survivor, new}
    head_of(s5, t5, 5, offline)
    cluster.probe(num_groups=2)  # both idle, every KV block free


def test_tandem_serve_with_address_auto_joins_the_running_cluster(cluster: Cluster, offline) -> None:
    cluster.run(*serve_cmd("shutdown", "--yes", "--address", cluster.dashboard))
    port, grpc_port = free_port(), free_port()
    log_path = cluster.base / "tandem_serve.log"
    env = {**cluster.env, "RAY_ADDRESS": cluster.gcs}  # what `auto` finds first
    cmd = [sys.executable, "-c", "import sys; from tandem.cli.main import main; sys.exit(main())", "serve",
           "--address", "auto", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                return True
            try:
                return requests.get(f"{base}/health", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        assert wait_for(ready, timeout_s=240, interval_s=1.0) and proc.poll() is None, log_path.read_text()[-4000:]
        r = requests.post(f"{base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt(7), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline[7, MAX_TOKENS]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    output = log_path.read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "Connecting to existing Ray cluster" in output, output[-4000:]
    assert "Started a local Ray instance" not in output
    assert cluster.head.is_running()


def _health(cluster: Cluster) -> int:
    try:
        return requests.get(f"{cluster.http}/health", timeout=5).status_code
    except requests.RequestException:
        return 0


def test_gpu_groups_wait_for_a_gpu_node_that_joins_after_the_deploy(cluster: Cluster) -> None:
    """A configuration that names its GPUs gets them however late the GPU nodes join: the group
    waits, then lands on the new node with a GPU reserved (never on a CPU node, on CPU). The
    simulated device stands for the GPU, so the logical one is enough."""
    cluster.run(*serve_cmd("shutdown", "--yes", "--address", cluster.dashboard))
    http_port = free_port()
    config = multi_node_config(http_port, free_port())
    [app] = config["applications"]
    app["args"].update(num_replicas=1, pipeline_parallel_size=1, simulated_step_ms="1,0.01", accelerator_type="H100")
    app["deployments"] = app["deployments"][:1]  # the ingress on the head; the group where its GPU is
    path = cluster.base / "gpu_serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cluster.run(*serve_cmd("deploy", str(path), "--address", cluster.dashboard))

    # The ingress starts (the application is being deployed, its CPU nodes are there): a group
    # that did not wait for its GPU would have been placed by then too.
    assert wait_for(lambda: cluster.ask({"replicas": "OpenAIIngress"}, timeout_s=60)["replicas"], timeout_s=120,
                    interval_s=1.0)
    time.sleep(2.0)
    seen = cluster.ask({"replicas": "GroupServer"}, timeout_s=60)
    assert seen["replicas"] == [] and seen["status"] != "RUNNING", seen

    node = start_node(cluster.base, "gpu1", cluster.env, head_address=cluster.gcs, num_cpus=2,
                      resources={"accelerator_type:H100": 1}, extra=("--num-gpus=1",), diagnose=cluster.head)
    cluster.started.append(node)

    def placed() -> bool:
        seen.update(cluster.ask({"replicas": "GroupServer"}, timeout_s=60))
        return seen["status"] == "RUNNING"

    assert wait_for(placed, timeout_s=300, interval_s=2.0), seen
    [replica] = seen["replicas"]
    assert replica["node_resources"]["GPU"] == 1 and replica["node_resources"]["accelerator_type:H100"] == 1
    assert replica["required_resources"]["GPU"] == 1
    r = requests.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt(0), "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    cluster.run(*serve_cmd("shutdown", "--yes", "--address", cluster.dashboard))
