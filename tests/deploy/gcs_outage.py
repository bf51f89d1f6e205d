"""Ray's GCS dying under a running tandem, with GCS fault tolerance (its tables in Redis):
what clients see, and for how long.

A head of its own (`ray start --head` with RAY_REDIS_ADDRESS and --redis-password, on free
ports; tests/deploy/ray_nodes.py), a redis-server of its own, and the application of
deploy/serve_config.yaml with one group of the demo model, deployed with `serve deploy`.
`measure_outage` SIGKILLs the GCS, sends completions while it is down, starts it again with
the same arguments, and times the service and the control plane coming back.

Shared by tests/deploy/test_gcs_fault_tolerance.py and the repeatable measurement behind
bench/RESULTS.md, run from the repository root:

    python3 -m tests.deploy.gcs_outage [--runs 5] [--down-s 15]

(here, not in bench/: it starts nodes with the test helpers, which the installed package lacks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from tandem.cli import deploy as deploy_cli
from tandem.cluster.net import free_port
from tests.deploy.ray_nodes import DetachedHead, RedisServer, cluster_env, serve_cmd, start_ft_head, start_redis

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tandem-demo"
PROBE_PROMPT = "the head node fails"
PROBE_TOKENS = 16


@dataclass
class FtCluster:
    base: Path
    env: dict[str, str]
    redis: RedisServer
    head: DetachedHead
    dashboard: str
    http: str


@dataclass
class Reply:
    status: int  # 0: no HTTP answer (refused, reset, timed out)
    text: str
    group: str
    error: str = ""


@dataclass
class StreamLog:
    """One streamed completion as the client saw it: each SSE data line with its arrival time."""

    events: list[tuple[float, Any]] = field(default_factory=list)  # (time.monotonic(), dict | "[DONE]")
    failure: str = ""  # the client's exception, if the connection broke or went silent

    @property
    def text(self) -> str:
        return "".join(c["text"] for _, e in self.events if isinstance(e, dict) for c in e.get("choices", ()))

    @property
    def num_chunks(self) -> int:
        return sum(1 for _, e in self.events if isinstance(e, dict) and e.get("choices"))

    def ending(self) -> str:
        """How it ended: "finished" ([DONE] after a finish_reason), "error" ([DONE] after an error
        event), else what went wrong: "truncated" (it stopped without both) or the client's failure."""
        if self.failure:
            return f"failed: {self.failure}"
        if len(self.events) < 2 or self.events[-1][1] != "[DONE]":
            return "truncated"
        last = self.events[-2][1]
        if "error" in last:
            return "error"
        return "finished" if any(c.get("finish_reason") for c in last.get("choices", ())) else "truncated"


def serve_config(http_port: int, grpc_port: int) -> dict[str, Any]:
    """deploy/serve_config.yaml with one group, its HTTP and gRPC proxies on the head on free ports."""
    config = deploy_cli.serve_config(deploy_cli.load_serve_config(ROOT / deploy_cli.DEFAULT_CONFIG),
                                     deploy_cli.Layout(num_replicas=1))
    config["proxy_location"] = "HeadOnly"
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    return config


@contextmanager
def ft_cluster(num_cpus: int = 4, deploy_timeout_s: float = 240.0) -> Iterator[FtCluster]:
    """Redis, a head whose GCS keeps its tables there, and tandem deployed on it and healthy."""
    base = Path(tempfile.mkdtemp(prefix="tdg-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = cluster_env()
    redis = head = None
    try:
        redis = start_redis(base)
        head, _, dashboard = start_ft_head(base, env, redis, num_cpus=num_cpus, resources={})
        http_port = free_port()
        path = base / "serve_config.yaml"
        path.write_text(yaml.safe_dump(serve_config(http_port, free_port()), sort_keys=False))
        out = serve(env, "deploy", str(path), "--address", dashboard)
        assert out.returncode == 0, f"serve deploy failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        cluster = FtCluster(base, env, redis, head, dashboard, f"http://127.0.0.1:{http_port}")
        deadline = time.monotonic() + deploy_timeout_s
        while not healthy(cluster):
            app = app_status(cluster)
            # A failed deployment does not heal: say so now rather than at the deadline.
            failed = app is not None and app["status"] == "DEPLOY_FAILED"
            assert not failed and time.monotonic() < deadline, f"tandem not healthy in {deploy_timeout_s} s:\n{app}"
            time.sleep(0.5)
        yield cluster
    finally:
        if head is not None:
            head.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(base, ignore_errors=True)


def serve(env: dict[str, str], *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(serve_cmd(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def healthy(cluster: FtCluster) -> bool:
    try:
        return requests.get(f"{cluster.http}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def app_status(cluster: FtCluster, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The dashboard's view of the application (Serve's controller, found through the GCS);
    None when it does not answer in time, as while the GCS is down."""
    try:
        reply = requests.get(f"{cluster.dashboard}/api/serve/applications/", timeout=timeout_s,
                             headers={"Authorization": f"Bearer {cluster.env['RAY_AUTH_TOKEN']}"})
    except requests.RequestException:
        return None
    return reply.json()["applications"].get("tandem") if reply.status_code == 200 else None


def running_replicas(cluster: FtCluster, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """{"status": the application's, deployment: its running replicas}; None as app_status."""
    app = app_status(cluster, timeout_s)
    if app is None:
        return None
    return {"status": app["status"], **{name: [r["replica_id"] for r in d["replicas"] if r["state"] == "RUNNING"]
                                        for name, d in app["deployments"].items()}}


def complete(cluster: FtCluster, prompt: str, max_tokens: int, timeout_s: float = 30.0) -> Reply:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        r = requests.post(f"{cluster.http}/v1/completions", json=body, timeout=timeout_s)
    except requests.RequestException as exc:
        return Reply(0, "", "", repr(exc))
    if r.status_code != 200:
        return Reply(r.status_code, "", "", r.text[:500])
    return Reply(200, r.json()["choices"][0]["text"], r.headers.get("x-tandem-groups", ""))


def read_stream(cluster: FtCluster, prompt: str, max_tokens: int, log: StreamLog, read_timeout_s: float = 60.0) -> None:
    """Stream a completion into `log` (a thread's target). `read_timeout_s` of silence is a hang."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with requests.post(f"{cluster.http}/v1/completions", json=body, stream=True,
                           timeout=(10, read_timeout_s)) as r:
            if r.status_code != 200:
                log.failure = f"HTTP {r.status_code}: {r.text[:500]}"
                return
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    data = line[len(b"data: "):]
                    log.events.append((time.monotonic(), "[DONE]" if data == b"[DONE]" else json.loads(data)))
    except requests.RequestException as exc:
        log.failure = repr(exc)


def start_stream(cluster: FtCluster, prompt: str, max_tokens: int) -> tuple[StreamLog, threading.Thread]:
    log = StreamLog()
    thread = threading.Thread(target=read_stream, args=(cluster, prompt, max_tokens, log), daemon=True)
    thread.start()
    return log, thread


@dataclass
class Outage:
    """One GCS kill and restart, times in seconds."""

    gap_s: float  # from the kill until a request sent after it was served (the time without service)
    probe_s: float  # one probe completion's latency just before the kill (median of 3): gap_s's floor
    gone_s: float  # from the SIGKILL until the GCS process was gone (the first probe goes then)
    served_while_down: int  # completions sent while the GCS was down and served with the right text
    failed_while_down: int  # ... that failed (no answer, an error status), and /health not 200 in time
    wrong_while_down: int  # ... answered with another text than before the kill
    down_s: float  # from the kill to the restart
    served_after_restart_s: float  # from the restart until a new request was served
    control_back_s: float  # from the restart until the dashboard reports the application RUNNING again
    failures: list[str] = field(default_factory=list)  # what the failed ones got


def measure_outage(cluster: FtCluster, reference: str, *, down_s: float, interval_s: float = 0.2,
                   timeout_s: float = 60.0) -> Outage:
    """Kill the GCS, send PROBE_PROMPT completions one after another for `down_s`, each with a
    readiness check (/health, what a load balancer asks), start the GCS again, and wait for a
    served completion and the control plane. `reference`: the probe's greedy text from before
    the kill."""
    served = failed = wrong = 0
    failures: list[str] = []
    first_served = None
    latencies = []
    for _ in range(3):
        started = time.monotonic()
        assert complete(cluster, PROBE_PROMPT, PROBE_TOKENS).text == reference, "not serving before the kill"
        latencies.append(time.monotonic() - started)
    killed = cluster.head.kill_gcs()
    gone = time.monotonic()
    while time.monotonic() - killed < down_s:
        reply = complete(cluster, PROBE_PROMPT, PROBE_TOKENS, timeout_s=max(1.0, down_s))
        if reply.status == 200 and reply.text == reference:
            served += 1
            first_served = first_served or time.monotonic()
        elif reply.status == 200:
            wrong += 1
        else:
            failed += 1
            failures.append(f"{reply.status} {reply.error[:200]}")
        if not healthy(cluster):
            failed += 1
            failures.append("/health: not 200 within 5 s")
        time.sleep(interval_s)
    cluster.head.restart_gcs()
    restarted = time.monotonic()
    while (reply := complete(cluster, PROBE_PROMPT, PROBE_TOKENS, timeout_s=5.0)).text != reference:
        if time.monotonic() - restarted > timeout_s:
            raise AssertionError(f"no completion served {timeout_s} s after the GCS restarted: {reply}")
        time.sleep(interval_s)
    served_after = time.monotonic()
    first_served = first_served or served_after
    while (app := app_status(cluster, timeout_s=2.0)) is None or app["status"] != "RUNNING":
        if time.monotonic() - restarted > timeout_s:
            raise AssertionError(f"the application not RUNNING {timeout_s} s after the GCS restarted: {app}")
        time.sleep(interval_s)
    return Outage(gap_s=first_served - killed, probe_s=statistics.median(latencies), gone_s=gone - killed,
                  served_while_down=served, failed_while_down=failed, wrong_while_down=wrong, down_s=restarted - killed,
                  served_after_restart_s=served_after - restarted, control_back_s=time.monotonic() - restarted,
                  failures=failures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="GCS kills and restarts, one after another (default 5)")
    parser.add_argument("--down-s", type=float, default=15.0, help="how long the GCS stays down each time "
                        "(default 15: past the 10 s after which the ingress used to wait for Serve's controller)")
    args = parser.parse_args()
    from tandem.cluster.direct_ingress import default_proxy, use_proxy

    use_proxy(default_proxy())  # as `tandem serve` does; before cluster_env copies the environment
    started = time.monotonic()
    with ft_cluster() as cluster:
        print(f"cluster up and tandem healthy in {time.monotonic() - started:.1f} s", flush=True)
        reference = complete(cluster, PROBE_PROMPT, PROBE_TOKENS).text
        runs = []
        for i in range(args.runs):
            outage = measure_outage(cluster, reference, down_s=args.down_s)
            runs.append(outage)
            print(json.dumps({"run": i, **asdict(outage)}), flush=True)
    medians = {name: round(statistics.median(getattr(r, name) for r in runs), 3)
               for name in ("gap_s", "probe_s", "gone_s", "down_s", "served_after_restart_s", "control_back_s")}
    totals = {name: sum(getattr(r, name) for r in runs)
              for name in ("served_while_down", "failed_while_down", "wrong_while_down")}
    print(json.dumps({"runs": args.runs, "median": medians, "total": totals}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
