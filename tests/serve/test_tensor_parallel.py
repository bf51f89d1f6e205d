"""A TP=2 replica group behind the API gives the offline LLM's greedy text, token for token,
also after one of its workers is killed (the group starts new workers in place); its
streams travel over Serve-call channels (channel_transport "serve")."""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest

from tandem.bench.load_generator import httpx
from tests.serve.conftest import serve_app, wait_for

KEY = "operator"  # GET /admin/kv needs one
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

PROMPTS = ["The quick brown fox", "It was the best of times, it was the worst of times"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline_texts(tiny_llama) -> list[str]:
    from tandem.workers.core.request import SamplingParams
    from tandem.workers.llm import LLM

    llm = LLM(model=tiny_llama, max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def server(shared_ray, tiny_llama, offline_texts):
    # Its streams' channels are Serve calls (channel_transport "serve"): the other Serve
    # modules stream over the groups' channel sockets, the default.
    with serve_app({"model": tiny_llama, "tensor_parallel_size": 2, "max_model_len": 256,
                    "num_kv_blocks": 64, "served_model_name": "tiny", "api_key": KEY,
                    "channel_transport": "serve"}) as url:
        yield url


def test_tp2_greedy_text_equals_offline_llm(server, offline_texts):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == offline_texts
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == offline_texts[0]


def test_killed_worker_is_replaced_in_place_and_serves_the_same_text(server, offline_texts):
    import ray

    def placement_groups() -> list[str]:
        return sorted(pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED")

    report = httpx.get(server + "/admin/kv", headers=AUTH, timeout=30).json()
    [(group_id, group)] = report["groups"].items()
    old, reserved = group["worker_pids"], placement_groups()
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"]
        os.kill(old[1], signal.SIGKILL)
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert (json.loads(events[-2])["error"]["code"], events[-1]) == ("service_unavailable", "[DONE]")

    def rebuilt() -> bool:
        groups = httpx.get(server + "/admin/kv", headers=AUTH, timeout=30).json()["groups"]
        g = groups.get(group_id, {})
        return g.get("healthy", False) and g.get("num_rebuilds") == 1

    assert wait_for(rebuilt, timeout_s=90)  # the same replica (no new group id), on new workers
    report = httpx.get(server + "/admin/kv", headers=AUTH, timeout=30).json()
    assert list(report["groups"]) == [group_id] and not set(report["groups"][group_id]["worker_pids"]) & set(old)
    assert placement_groups() == reserved  # the new workers took the replica's own bundles
    test_tp2_greedy_text_equals_offline_llm(server, offline_texts)
    assert wait_for(lambda: httpx.get(server + "/admin/kv", headers=AUTH, timeout=30).json()["device_blocks_held"] == 0,
                    timeout_s=30)
