"""deploy/serve_config.yaml: valid, and `serve run` on it starts and answers a completion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from tests.serve.conftest import free_port, wait_for

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def test_config_validates_and_builds():
    from ray.serve.schema import ServeDeploySchema

    from tandem.router.app import build_app

    config = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(config)
    [app] = schema.applications
    assert app.import_path == "tandem.router.app:build_app"
    assert schema.grpc_options.grpc_servicer_functions == [
        "tandem.router.grpc_proxy.add_TandemServicer_to_server"]
    build_app(app.args)  # every arg is known and valid


def _serve_cmd() -> list[str]:
    # Serve's CLI in this interpreter: a `serve` found on PATH may be another Python's, with
    # another tandem (and a rebuild of the CPU kernels from its sources).
    return [sys.executable, "-c", "from ray.serve.scripts import cli; cli()"]


@pytest.mark.slow
def test_serve_run_answers_a_completion(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())
    http_port, grpc_port = free_port(), free_port()
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "serve_run.log", "w+")
    # address "local": a Ray of its own even if this machine runs another (`ray start`) cluster.
    proc = subprocess.Popen([*_serve_cmd(), "run", str(path)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_ADDRESS": "local"}, start_new_session=True)
    base = f"http://127.0.0.1:{http_port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            return True  # exited: stop waiting, the asserts below say why
        try:
            return requests.get(f"{base}/health", timeout=5).status_code == 200
        except requests.RequestException:  # not listening yet, or still deploying
            return False

    try:
        assert wait_for(healthy, timeout_s=240, interval_s=1.0) and proc.poll() is None, _tail(log)
        r = requests.post(f"{base}/v1/completions", timeout=60,
                          json={"model": "tandem-demo", "prompt": "Hello, tandem", "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
                proc.wait()
    log.close()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
