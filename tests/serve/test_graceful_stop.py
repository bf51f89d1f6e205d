"""A group that Serve stops gracefully (a redeploy replaces it) finishes the streams it runs,
those sent on the ingress's channel too: they are no Serve calls of their own, and the
ingress's `hold` call is what keeps Serve's drain of the group waiting for them
(router/group_channels.py)."""

from __future__ import annotations

import json
import threading

import pytest
import requests

from tests.serve.conftest import APP_NAME, group_handle, serve_app, wait_for

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

# A simulated device of 20 ms steps: a stream of 300 tokens runs 6 s, long enough to redeploy under.
ARGS = {"simulated_step_ms": "20,0", "max_num_seqs": 8, "ingress_num_replicas": 1}


class Stream(threading.Thread):
    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.events: list[dict] = []

    def run(self) -> None:
        body = {"model": "tandem-demo", "prompt": "Hello there", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    self.events.append(json.loads(line[len(b"data: "):]))
                    self.first.set()
        self.first.set()

    def outcome(self) -> tuple:
        finish = [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c["finish_reason"]]
        return self.events[-1].get("usage", {}).get("completion_tokens"), finish, \
            [e["error"]["code"] for e in self.events if "error" in e]


def test_a_redeploy_lets_the_streams_sent_on_the_channel_finish(shared_ray) -> None:
    from ray import serve

    from tandem.router.app import build_app

    with serve_app(ARGS) as url:
        # The first stream goes on a call and opens the ingress's channel; the second goes on it.
        opener = Stream(url, max_tokens=40)
        opener.start()
        assert opener.first.wait(60)
        before = group_handle().stats.remote().result().channel_requests
        sent = Stream(url, max_tokens=300)
        sent.start()
        assert sent.first.wait(60)
        opener.join(60)
        assert group_handle().stats.remote().result().channel_requests == before + 1
        # Only the request sent on the channel runs now; a changed option replaces the group.
        old = group_handle().stats.remote().result().group_id
        serve._run(build_app({"group_num_cpus": 1, **ARGS, "seed": 1}), name=APP_NAME, route_prefix="/",
                   _blocking=False)
        sent.join(120)
        assert opener.outcome() == (40, ["length"], [])
        assert sent.outcome() == (300, ["length"], [])  # whole, no error event
        assert wait_for(lambda: group_handle().stats.remote().result().group_id != old, timeout_s=60)
