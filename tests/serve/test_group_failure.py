"""A group that dies mid-request, and a request whose own timeout passes, against a real
Serve application (two TP=1 groups of the demo model): the client always gets a final
answer, and no KV block stays held (read through `GET /admin/kv`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tandem.bench.load_generator import httpx
from tests.serve.conftest import serve_app, wait_for

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

KEY = "operator"  # GET /admin/kv needs one
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": [11, 12, 13], "max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def url(shared_ray) -> Iterator[str]:
    from tandem.workers.model.demo_model import demo_model_path

    with serve_app({"model": demo_model_path(), "num_replicas": 2, "api_key": KEY}) as base:
        assert wait_for(lambda: httpx.get(base + "/health", timeout=10).status_code == 200, timeout_s=120)
        yield base


def kv(url: str) -> dict:
    return httpx.get(url + "/admin/kv", headers=AUTH, timeout=30).json()


def drained(url: str) -> bool:
    report = kv(url)
    return (report["device_blocks_held"], report["host_blocks_held"], report["stale_lease_blocks"],
            report["requests_in_flight"], report["unreachable_groups"]) == (0, 0, 0, 0, [])


def test_timeout_is_a_408_and_frees_the_kv(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={**LONG, "timeout": 0.2}, headers=AUTH, timeout=60)
    assert r.status_code == 408
    assert r.json()["error"]["code"] == "request_timeout" and r.json()["error"]["param"] == "timeout"
    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "timeout": 1.0, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"
    assert wait_for(lambda: drained(url), timeout_s=30)


def test_group_killed_mid_stream_ends_with_an_error_event_then_others_serve(url: str) -> None:
    import ray

    with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        group = r.headers["x-tandem-groups"]
        lines = r.iter_lines()
        assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"]
        report = kv(url)
        assert report["groups"][group]["device_blocks_held"] > 0  # the stream's blocks
        ray.kill(ray.get_actor(report["groups"][group]["actor_name"], namespace="serve"), no_restart=True)
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert (error["code"], events[-1]) == ("service_unavailable", "[DONE]")
    assert "replica group failed" in error["message"]
    # The other group serves at once (a request sent to the dead one is retried there).
    for _ in range(4):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, headers=AUTH,
                       timeout=60)
        assert r.status_code == 200
    # Nothing stays held: the dead group is gone from the report, the allocator has dropped its
    # lease (Serve's replacement group may still be starting: it is not waited for).
    def released() -> bool:
        report = kv(url)
        return group not in report["groups"] and (report["device_blocks_held"], report["host_blocks_held"],
                                                  report["stale_lease_blocks"]) == (0, 0, 0)

    assert wait_for(released, timeout_s=60, interval_s=1.0)
