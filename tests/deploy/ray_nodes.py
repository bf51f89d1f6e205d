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
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.cluster.local_ray import descendants, running
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
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        tree |= descendants(self.proc.pid)
        deadline = time.monotonic() + 10
        while (alive := {p for p in tree if running(p)}) and time.monotonic() < deadline:
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


# ---- GCS fault tolerance: an external Redis, and a head whose GCS can die alone --------------------
@dataclass
class RedisServer:
    """A redis-server of the test's own: on a free port, password-protected (as Ray's GCS fault
    tolerance documents it), nothing written to disk (it lives only as long as the test)."""

    proc: subprocess.Popen
    port: int
    password: str
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self, *args: str, timeout_s: float = 5.0) -> bytes:
        """One authenticated command's raw RESP reply (e.g. `command("DBSIZE")` -> b":42")."""
        request = b"".join(_resp(("AUTH", self.password)) + _resp(args))
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as conn:
            conn.sendall(request)
            reply = b""
            while reply.count(b"\r\n") < 2:  # "+OK" for AUTH, then the command's one-line reply
                data = conn.recv(4096)
                if not data:
                    break
                reply += data
        auth, _, rest = reply.partition(b"\r\n")
        if auth != b"+OK":
            raise RuntimeError(f"redis refused the password: {auth!r}")
        return rest.removesuffix(b"\r\n")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _resp(args: tuple[str, ...]) -> list[bytes]:
    return [f"*{len(args)}\r\n".encode()] + [f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args]


def start_redis(base: Path, timeout_s: float = 15.0) -> RedisServer:
    """Start redis-server (Debian's package: `apt-get install redis-server`) and wait until it
    answers. A free port can be taken by another process before Redis binds it: up to three ports."""
    password = secrets.token_hex(16)
    for attempt in range(3):
        port = free_port()
        log_path = base / f"redis{attempt}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
                 "--save", "", "--appendonly", "no", "--dir", str(base)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        redis = RedisServer(proc, port, password, log_path)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if redis.command("PING") == b"+PONG":
                    return redis
            except OSError:
                time.sleep(0.1)
        redis.stop()
    raise RuntimeError(f"redis-server did not start:\n{log_path.read_text(errors='replace')[-2000:]}")


@dataclass
class DetachedHead:
    """A head started by `ray start --head` without `--block`, with GCS fault tolerance (an
    external Redis). Not `--block`: that `ray start` tears the whole node down once any of its
    processes dies of a signal, as a head container does; here the GCS dies alone and starts
    again with its own command line and environment, as Ray's GCS fault-tolerance tests do it
    (`Node.kill_gcs_server` / `Node.start_gcs_server`: same arguments, same port). Every
    process of the node is in the session of its `ray start` (its id: `session`); a GCS
    started again is in a session of its own (`restarted`)."""

    node: RayNode  # its `ray start` has exited; the logs and the temp dir are still there
    session: int
    restarted: list[subprocess.Popen] = field(default_factory=list)
    _gcs: tuple[list[bytes], dict[bytes, bytes]] | None = None  # the GCS's argv and environment

    def gcs_pid(self) -> int | None:
        pids = session_members(self.session) + [p.pid for p in self.restarted if p.poll() is None]
        return next((pid for pid in pids if _argv(pid)[:1] and _argv(pid)[0].endswith(b"/gcs_server")), None)

    def kill_gcs(self) -> float:
        """SIGKILL the GCS (its command line kept for `restart_gcs`); returns the kill's
        time.monotonic(), once the process is gone."""
        pid = self.gcs_pid()
        if pid is None:
            raise RuntimeError("the head has no GCS process to kill")
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        self._gcs = (_argv(pid), environ)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for proc in self.restarted:
            if proc.pid == pid:
                proc.wait(timeout=10)  # reap it: a zombie of ours would look alive
        deadline = time.monotonic() + 10
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return killed

    def restart_gcs(self) -> None:
        """Start the GCS again, with the killed one's arguments (its port, its session, Redis)."""
        if self._gcs is None:
            raise RuntimeError("restart_gcs before kill_gcs")
        argv, environ = self._gcs
        self.restarted.append(subprocess.Popen(argv, env=environ, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True))

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM every process of the node, then SIGKILL what is left after `grace_s`."""
        def members() -> list[int]:
            return session_members(self.session) + [p.pid for p in self.restarted if p.poll() is None]

        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pid in members():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while members() and time.monotonic() < deadline:
                for proc in self.restarted:
                    proc.poll()  # reap our own
                time.sleep(0.1)


def start_ft_head(base: Path, env: dict[str, str], redis: RedisServer, *, num_cpus: int,
                  resources: dict[str, float], timeout_s: float = 120.0) -> tuple[DetachedHead, str, str]:
    """(head, GCS address, dashboard URL) of a head on free ports whose GCS keeps its tables in
    `redis` (RAY_REDIS_ADDRESS and --redis-password, Ray 2.60's way for `ray start`)."""
    temp_dir, log_path, dashboard_port = base / "head", base / "head.log", free_port()
    temp_dir.mkdir(parents=True)
    # The agent ports are given for the reason start_node gives them.
    args = ["start", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--resources={json.dumps(resources)}", "--object-store-memory=100000000",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            "--head", f"--port={free_port()}", "--include-dashboard=true", f"--dashboard-port={dashboard_port}",
            "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}",
            f"--redis-password={redis.password}"]
    # The raylet (and every worker) ends itself once the GCS has been unreachable this long
    # (Ray's 60 s): on a loaded host the outage a test makes (streams of 400 tokens across it)
    # can outlast that, and the node would die under a test of what outlives the GCS.
    ft_env = {**env, "RAY_REDIS_ADDRESS": redis.address, "RAY_gcs_rpc_server_reconnect_timeout_s": "300"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(ray_cmd(*args), stdout=log, stderr=subprocess.STDOUT, env=ft_env,
                                start_new_session=True)
    head = DetachedHead(RayNode(proc, temp_dir, log_path), session=proc.pid)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and not head.node.raylet_crashed() and time.monotonic() < deadline:
        time.sleep(0.3)
    match = re.search(r"ray start --address='([^']+)'", head.node.log())
    if proc.poll() != 0 or match is None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # its stacks, into its log
            time.sleep(1.0)
        report = f"ray start (head, GCS on Redis) failed or timed out:\n{head.node.log()[-6000:]}"
        head.stop(grace_s=1.0)
        raise RuntimeError(report + head.node.session_logs(
            ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")))
    return head, match.group(1), f"http://127.0.0.1:{dashboard_port}"


def session_members(session: int) -> list[int]:
    """The running processes of session `session` (zombies left out)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(entry))
    return members


def _argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[:-1]
    except OSError:
        return []
