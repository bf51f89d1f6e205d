"""The KV report (`GET /admin/kv`, `tandem bench soak`) reads each group from its replica actor,
never through a DeploymentHandle: a handle's router with a stale replica set sent every group's
stats call to one group, and the soak listed the other as unreachable for minutes while it served."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tandem.bench.load_generator import httpx
from tests.serve.conftest import APP_NAME, serve_app, wait_for

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

KEY = "operator"
AUTH = {"Authorization": f"Bearer {KEY}"}
# 20 ms a step (the simulated device): the streams run for seconds while the report is read.
LONG = {"prompt": [11, 12, 13], "max_tokens": 1000, "ignore_eos": True, "temperature": 0.0, "stream": True}


@pytest.fixture(scope="module")
def url(shared_ray) -> Iterator[str]:
    from tandem.workers.model.demo_model import demo_model_path

    with serve_app({"model": demo_model_path(), "num_replicas": 2, "api_key": KEY,
                    "simulated_step_ms": "20,0"}) as base:
        assert wait_for(lambda: httpx.get(base + "/health", timeout=10).status_code == 200, timeout_s=120)
        yield base


def _first_chunk(lines: Iterator[str]) -> None:
    assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"]


def test_every_group_reports_from_its_replica_actor(url: str, monkeypatch) -> None:
    from ray import serve

    from tandem.router.kv_report import group_replicas, kv_holdings

    def no_handle(*args, **kwargs):
        raise AssertionError("the report must not go through a DeploymentHandle")

    monkeypatch.setattr(serve, "get_deployment_handle", no_handle)
    with (httpx.stream("POST", url + "/v1/completions", json=LONG, headers=AUTH, timeout=60) as one,
          httpx.stream("POST", url + "/v1/completions", json=LONG, headers=AUTH, timeout=60) as two):
        # The line iterators are held until the report is read: httpx closes a response whose
        # iterator is dropped, and the server then aborts its stream (the report raced the aborts).
        lines = [one.iter_lines(), two.iter_lines()]
        for stream_lines in lines:
            _first_chunk(stream_lines)
        report = kv_holdings(APP_NAME)
        assert report["unreachable_groups"] == [] and sorted(report["groups"]) == sorted(group_replicas(APP_NAME))
        # The groups that answered each stream (the response header) beside the report, whole.
        served_by = [one.headers.get("x-tandem-groups"), two.headers.get("x-tandem-groups")]
        assert sum(g["num_running"] for g in report["groups"].values()) == 2 and report["device_blocks_held"] > 0, \
            f"streams served by {served_by}; report {json.dumps(report, default=str)}"
        assert httpx.get(url + "/admin/kv", headers=AUTH, timeout=30).json()["groups"].keys() == report["groups"].keys()
    # The clients left: both requests are aborted and their blocks freed.
    assert wait_for(lambda: kv_holdings(APP_NAME)["device_blocks_held"] == 0, timeout_s=30)
