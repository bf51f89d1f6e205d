"""The ingress's budget of messages a second paces its streams in the group: each request names
its group's share, the group gives the channel's streams equal parts of it, and the engine
holds a stream's tokens between its outputs. The first token still goes at once, and what the
chunks say together is exactly the answer given whole."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.serve.conftest import serve_app

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

MODEL = "tiny"
TOKENS = 30
STREAMS = 3


@pytest.fixture(scope="module")
def server(shared_ray, tiny_llama):
    # 0.1 messages a second: with 3 streams, 30 s between two of a stream's messages, far more
    # than any of these requests takes, so each says its first token, then the rest at its end.
    # Multi-step steps: the pace holds the tokens anyway, so the streams' steps run all four
    # passes (GroupEngine.max_passes), and what they say is still the answer given whole.
    args = {"model": tiny_llama, "served_model_name": MODEL, "max_model_len": 256, "num_kv_blocks": 64,
            "block_size": 16, "ingress_num_replicas": 1, "ingress_max_chunks_per_s": 0.1, "num_scheduler_steps": 4}
    with serve_app(args) as url:
        yield url


def _body(i: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": f"Paced stream {i} says", "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "stream": stream}


def _whole(url: str, i: int) -> tuple[str, list[str]]:
    r = requests.post(f"{url}/v1/completions", json=_body(i, False), timeout=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    return choice["text"], choice["logprobs"]["tokens"]


def _streamed(url: str, i: int) -> tuple[str, list[str], list[int]]:
    text, tokens, per_chunk = "", [], []
    with requests.post(f"{url}/v1/completions", json=_body(i, True), stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                [choice] = json.loads(line[6:])["choices"]
                got = choice["logprobs"]["tokens"]
                text, tokens = text + choice["text"], tokens + got
                per_chunk.append(len(got))
    return text, tokens, per_chunk


def test_each_stream_says_its_first_token_at_once_and_the_rest_when_the_budget_allows(server):
    expected = [_whole(server, i) for i in range(STREAMS)]
    _streamed(server, 99)  # the ingress's channel to the group is open: the streams below go on it
    with ThreadPoolExecutor(STREAMS) as pool:
        answers = list(pool.map(lambda i: _streamed(server, i), range(STREAMS)))
    for (text, tokens, per_chunk), (whole_text, whole_tokens) in zip(answers, expected):
        assert (text, tokens) == (whole_text, whole_tokens)
        assert per_chunk == [1, TOKENS - 1]
