"""Ray nodes started the way an operator starts them: `ray start --head` and `ray start
--address=...`, each a `--block` process of its own (its own session, temp dir and ports).

Stopping a node sends SIGTERM to its `ray start` process, which tears down the node's
processes (raylet, GCS, agents); whatever of the node's process tree outlives that is killed
by pid. Nothing here touches another Ray instance on the machine (no machine-wide `ray stop`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.cluster.net import free_port

# SIGUSR1 makes a node's `ray start` write every thread's stack to its log: a start that
# hangs says where (see start_node).
_RAY_CLI = ("import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "from ray.scripts.scripts import main; main()")
_SERVE_CLI = "from ray.serve.scripts import cli; cli()"
# Ray's C++ log lines: "[time E pid tid] ..." (error) and "F" (fatal, a failed check).
_SEVERE = re.compile(r"^\[[^\]]* [EF] \d+ \d+\]|Check failed|\*\*\* SIG")


def ray_cmd(*args: str) -> list[str]:
    """`ray ...` through this interpreter, so every node's workers import this checkout's tandem."""
    return [sys.executable, "-c", _RAY_CLI, *args]


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", _SERVE_CLI, *args]


def cluster_env(token: str | None = None) -> dict[str, str]:
    """The environment of every process of the test cluster and of the CLI calls against it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token or secrets.token_hex(32),  # a token of its own
        RAY_USAGE_STATS_ENABLED="0",
        # A stopped node goes at once, as `ray stop` does, instead of draining for 30 s first.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        # A loaded 2-core machine can take longer than the default to start a node's agent.
        RAY_agent_register_timeout_ms="120000",
        # ... and longer than ray start's default 30 s for a new node to register with the GCS.
        RAY_raylet_start_wait_time_s="120",
        # Serve asks the router's first-ranked group for its queue length and, with no answer
        # within this deadline (0.1 s by default), sends the request to the next-ranked one:
        # on a loaded 2-core machine that was the busy group, again and again.
        RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S="1.0",
        # The torch path: no node waits on (or races another for) the first build of the C++
        # kernels; greedy output is the same either way.
        TANDEM_CPU_KERNELS="0",
    )
    return env


@dataclass
class RayNode:
    proc: subprocess.Popen
    temp_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def session_logs(self, names: tuple[str, ...] = ("raylet.out", "raylet.err", "gcs_server.out"),
                     tail: int = 2000) -> str:
        """The ends of the node's own Ray logs, for a failure message, each after its error
        and fatal lines (a crash's own message comes before a stack trace longer than the tail)."""
        out = []
        for name in names:
            for path in sorted(self.temp_dir.glob(f"session_*/logs/{name}")):
                if path.parent.parent.is_symlink():  # session_latest: the same files again
                    continue
                text = path.read_text(errors="replace")
                errors = [line for line in text.splitlines() if _SEVERE.search(line)][:40]
                out.append(f"\n--- {path.relative_to(self.temp_dir)}: error lines ---\n" + "\n".join(errors)
                           + f"\n--- {path.relative_to(self.temp_dir)}: end ---\n{text[-tail:]}")
        return "".join(out)

    def raylet_crashed(self) -> bool:
        """Whether the node's raylet has died of a failed check. Its `ray start` then hangs in
        get_node instead of exiting, so waiting it out would only cost the whole timeout."""
        return any("Check failed" in path.read_text(errors="replace")
                   for path in self.temp_dir.glob("session_*/logs/raylet.err"))

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the node's `ray start`, then SIGKILL what is left of its process tree."""
        tree = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        tree |= _descendants(self.proc.pid)
        deadline = time.monotonic() + 10
        while (alive := {p for p in tree if _alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in alive:  # workers that did not notice their raylet went away
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_node(base: Path, name: str, env: dict[str, str], *, head_address: str | None = None,
               num_cpus: int, resources: dict[str, float], timeout_s: float = 120.0,
               extra: tuple[str, ...] = (), diagnose: RayNode | None = None) -> RayNode:
    """Start one node (a head when `head_address` is None) and wait until it has joined.
    A start that fails or hangs raises with its stacks and logs, and the GCS log of
    `diagnose` (the head) when given."""
    temp_dir = base / name  # short: Ray's socket paths live under it
    temp_dir.mkdir(parents=True)
    args = ["start", "--block", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--resources={json.dumps(resources)}", "--object-store-memory=100000000",
            f"--dashboard-agent-listen-port={free_port()}",
            # Given agent ports: with port 0 the raylet waits ~15 s for each agent to write the
            # port it took to a file, and on a loaded 2-core machine that wait times out and
            # the raylet crashes ("Timed out waiting for file .../metrics_agent_port_*", then
            # ".../metrics_export_port_*"), leaving `ray start` hanging in get_node. It still
            # waits 15 s (fixed in Ray 2.60, whatever RAY_agent_register_timeout_ms says) for
            # the dashboard agent to write its HTTP port: a start that crashes there fails at
            # once (`raylet_crashed`), and the caller may start the node again.
            f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", *extra]
    args += ["--head"] if head_address is None else [f"--address={head_address}"]
    log_path = base / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(ray_cmd(*args), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    node = RayNode(proc, temp_dir, log_path)
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in node.log():
        crashed = node.raylet_crashed()
        if not node.is_running() or crashed or time.monotonic() > deadline:
            if node.is_running():
                proc.send_signal(signal.SIGUSR1)  # its stacks, into its log
                time.sleep(1.0)
            report = f"ray start {name} failed or timed out:\n{node.log()[-6000:]}{node.session_logs()}"
            if diagnose is not None:
                report += diagnose.session_logs(("gcs_server.out", "gcs_server.err"), tail=6000)
            node.stop(timeout_s=5.0 if crashed else 30.0)  # its `ray start` hangs: no use waiting
            raise RuntimeError(report)
        time.sleep(0.3)
    return node


def start_head(base: Path, env: dict[str, str], *, num_cpus: int,
               resources: dict[str, float]) -> tuple[RayNode, str, str]:
    """(node, GCS address, dashboard URL) of a new head on free ports."""
    dashboard_port = free_port()
    node = start_node(base, "head", env, num_cpus=num_cpus, resources=resources, extra=(
        f"--port={free_port()}", "--include-dashboard=true", f"--dashboard-port={dashboard_port}",
        "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}"))
    match = re.search(r"ray start --address='([^']+)'", node.log())
    if match is None:
        node.stop()
        raise RuntimeError(f"no address in the head's output:\n{node.log()[-3000:]}")
    return node, match.group(1), f"http://127.0.0.1:{dashboard_port}"


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> set[int]:
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
