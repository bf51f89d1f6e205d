"""Two replica groups behind one ingress: load-aware routing spreads requests; /health covers
all; both groups draft with one shared draft actor."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.serve.conftest import serve_app, wait_for

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop


@pytest.fixture(scope="module")
def server(shared_ray, tiny_llama):
    args = {"model": tiny_llama, "num_replicas": 2, "max_model_len": 256, "num_kv_blocks": 64,
            "served_model_name": "tiny", "speculative_model": tiny_llama, "num_speculative_tokens": 2}
    with serve_app(args) as url:
        yield url


def complete(server: str, prompt: str, max_tokens: int = 48) -> requests.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return r


def test_concurrent_requests_are_spread_over_both_groups(server):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: complete(server, f"request number {i}"), range(8)))
    groups = [r.headers["x-tandem-groups"] for r in responses]
    assert all(g and "," not in g for g in groups)
    assert len(set(groups)) == 2, groups
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses)


def test_one_request_with_many_prompts_can_use_both_groups(server):
    # Right after the previous test's burst: the router takes the requests it saw finish
    # off each group's polled load (up to a second old), or that burst would steer all six away.
    r = complete(server, "x", max_tokens=1)  # warm
    body = {"model": "tiny", "prompt": [f"prompt {i}" for i in range(6)], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert [c["index"] for c in r.json()["choices"]] == list(range(6))
    assert len(set(r.headers["x-tandem-groups"].split(","))) == 2


def _draft() -> dict:
    import ray

    from tandem.workers.spec.draft_proposer import DRAFT_NAMESPACE, draft_actor_name
    from tests.serve.conftest import APP_NAME

    return ray.get(ray.get_actor(draft_actor_name(APP_NAME), namespace=DRAFT_NAMESPACE).describe.remote(), timeout=30)


def test_both_groups_draft_with_one_shared_draft_actor(server, tiny_llama):
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM

    assert len(_draft()["attached"]) == 2  # one actor, both groups attached
    prompts = [f"shared draft {i}" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: complete(server, p, max_tokens=16), prompts))
    assert len({r.headers["x-tandem-groups"] for r in responses}) == 2
    used = _draft()["num_batches"]
    assert len([ns for ns, n in used.items() if n > 0]) == 2  # both groups asked it for drafts
    offline = LLM(tiny_llama)  # no speculation: the reference
    try:
        outs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                use_tqdm=False)
    finally:
        offline.shutdown()
    assert [r.json()["choices"][0]["text"] for r in responses] == [o.outputs[0].text for o in outs]


def test_health_stays_ready_but_degraded_while_a_group_is_down(server):
    import ray

    assert requests.get(f"{server}/health", timeout=30).json() == {"status": "ok", "groups": {"RUNNING": 2}}
    [victim, *_] = [a for a in ray.util.list_named_actors(all_namespaces=True) if "GroupServer" in a["name"]]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)

    def health() -> tuple[int, str]:
        response = requests.get(f"{server}/health", timeout=30)
        return response.status_code, response.json()["status"]

    # A load balancer keeps the service in (200) while the other group serves.
    assert wait_for(lambda: health() == (200, "degraded"), timeout_s=30, interval_s=0.2)
    assert complete(server, "still served", max_tokens=4).status_code == 200
    assert wait_for(lambda: health() == (200, "ok"), timeout_s=120, interval_s=0.5)
    time.sleep(0.5)
    assert complete(server, "both back", max_tokens=4).status_code == 200
