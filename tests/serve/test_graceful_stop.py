"""A group that stops under streams sent on the ingress's channel (no Serve call of their
own, router/group_channels.py), against a real Serve application of one group on a simulated
device:

- stopped gracefully (a redeploy replaces it), it finishes them: the ingress's `hold` call is
  what keeps Serve's drain of the group waiting for them;
- killed, it ends each of them with an error event at once, and its replacement serves.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import requests

from tests.serve.conftest import APP_NAME, group_handle, serve_app, wait_for

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

# A simulated device of 20 ms steps: a stream of 300 tokens runs 6 s, long enough to act under.
ARGS = {"simulated_step_ms": "20,0", "max_num_seqs": 8, "ingress_num_replicas": 1}


@pytest.fixture(scope="module")
def url(shared_ray) -> Iterator[str]:
    with serve_app(ARGS) as base:
        yield base


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


def group_stats():
    return group_handle().stats.remote().result()


def stream_on_the_channel(url: str, max_tokens: int) -> tuple[Stream, Stream]:
    """A first stream, sent on a call (it opens the ingress's channel), and a second, sent on
    that channel; returns them both running, the first within 40 tokens of its end."""
    opener = Stream(url, max_tokens=40)
    opener.start()
    assert opener.first.wait(60)
    before = group_stats().channel_requests
    sent = Stream(url, max_tokens=max_tokens)
    sent.start()
    assert sent.first.wait(60)
    assert group_stats().channel_requests == before + 1
    return opener, sent


def test_a_redeploy_lets_the_streams_sent_on_the_channel_finish(url: str) -> None:
    from ray import serve

    from tandem.router.app import build_app

    opener, sent = stream_on_the_channel(url, max_tokens=300)
    opener.join(60)
    # Only the request sent on the channel runs now; a changed option replaces the group.
    old = group_stats().group_id
    serve._run(build_app({"group_num_cpus": 1, **ARGS, "seed": 1}), name=APP_NAME, route_prefix="/",
               _blocking=False)
    sent.join(120)
    assert opener.outcome() == (40, ["length"], [])
    assert sent.outcome() == (300, ["length"], [])  # whole, no error event
    assert wait_for(lambda: group_stats().group_id != old, timeout_s=60)


def test_a_group_killed_ends_the_streams_sent_on_its_channel_with_an_error_event(url: str) -> None:
    import ray

    from tandem.router.kv_report import SERVE_NAMESPACE, group_replicas

    assert wait_for(lambda: len(group_replicas(APP_NAME)) == 1, timeout_s=60)  # the last test's redeploy done
    opener, sent = stream_on_the_channel(url, max_tokens=300)
    opener.join(60)
    [(group_id, actor_name)] = group_replicas(APP_NAME).items()
    ray.kill(ray.get_actor(actor_name, namespace=SERVE_NAMESPACE), no_restart=True)
    sent.join(60)
    assert not sent.is_alive()
    tokens, finish, errors = sent.outcome()
    assert (tokens, finish, errors) == (None, [], ["service_unavailable"])
    # Serve replaces the group; the next request is served by the new one.
    assert wait_for(lambda: set(group_replicas(APP_NAME)) - {group_id}, timeout_s=60)
    body = {"model": "tandem-demo", "prompt": "Hello", "max_tokens": 4}
    assert wait_for(lambda: requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200,
                    timeout_s=60)
