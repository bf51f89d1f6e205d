"""`tandem serve`: flags, an embedded Ray, where it listens, and a clean SIGTERM shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.serve.conftest import free_port


def test_serve_flags_become_build_app_args():
    from tandem.router.cli import build_parser
    from tandem.router.serve_cli import app_args

    args = build_parser().parse_args([
        "serve", "--model", "some/model", "--served-model-name", "m", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "1", "--num-replicas", "3", "--max-model-len", "512", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "1024", "--block-size", "32", "--kv-cache-memory", "1000000",
        "--dtype", "float32", "--host", "127.0.0.1", "--port", "8001", "--grpc-port", "9001",
        "--api-key", "k", "--address", "ray://x:10001", "--routing", "load", "--host-kv-cache-memory", "4096",
        "--host-kv-memory-per-node", "8192", "--kv-fetch", "never", "--no-cpu-packed-weights"])
    options = app_args(args)
    assert options == {
        "model": os.path.abspath("some/model"), "served_model_name": "m", "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1, "num_replicas": 3, "max_model_len": 512, "max_num_seqs": 8,
        "max_num_batched_tokens": 1024, "block_size": 32, "kv_cache_memory": 1000000, "dtype": "float32",
        "api_key": "k", "routing": "load", "host_kv_cache_memory": 4096, "host_kv_memory_per_node": 8192,
        "kv_fetch": "never", "cpu_packed_weights": False}
    assert (args.host, args.port, args.grpc_port, args.address) == ("127.0.0.1", 8001, 9001, "ray://x:10001")
    defaults = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.5"])
    assert app_args(defaults)["gpu_memory_utilization"] == 0.5 and "model" not in app_args(defaults)
    assert "cpu_packed_weights" not in app_args(defaults)  # the engine's default (on)
    assert (app_args(defaults)["routing"], app_args(defaults)["kv_fetch"]) == ("prefix", "auto")


def test_a_local_tp1_group_leaves_one_core_to_serve(monkeypatch):
    from tandem.router.app import local_group_num_cpus
    from tandem.router.cli import build_parser
    from tandem.router.serve_cli import app_args

    assert [local_group_num_cpus(1, c) for c in (1, 2, 8)] == [1, 1, 7]
    assert [local_group_num_cpus(n, 9) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert app_args(build_parser().parse_args(["serve"]))["group_num_cpus"] == 7
    assert app_args(build_parser().parse_args(["serve", "--num-replicas", "2"]))["group_num_cpus"] == 3
    # A TP>1 group's workers size their own threads; on a cluster the deployment's options decide.
    assert "group_num_cpus" not in app_args(build_parser().parse_args(["serve", "-tp", "2"]))
    assert "group_num_cpus" not in app_args(build_parser().parse_args(["serve", "--address", "auto"]))


def test_bad_option_fails_before_anything_starts(capsys):
    from tandem.router.cli import main

    assert main(["serve", "--block-size", "3"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_tandem_serve_answers_and_stops_on_sigterm(tiny_llama):
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.router.cli", "serve", "--model", tiny_llama, "--served-model-name", "tiny",
           "--max-model-len", "256", "--kv-cache-memory", str(4 << 20), "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", str(grpc_port), "--api-key", "secret"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
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
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": "Bearer secret"},
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        reader.join(timeout=10)
        assert any("shutting down" in line for line in lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
            proc.wait()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
