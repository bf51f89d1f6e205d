"""The OpenAI-compatible API end to end: the official `openai` client against a running app.

One Serve instance for the module: a tiny Llama, one replica group, an API key.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tandem.workers.serving.messages import GroupStats
from tests.serve.conftest import group_handle, serve_app, wait_for
from tests.serve.hostile_cases import HTTP_CASES

pytestmark = pytest.mark.slow  # a Serve application on Ray: not in the fast loop

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(shared_ray, tiny_llama):
    args = {"model": tiny_llama, "served_model_name": MODEL, "api_key": API_KEY,
            "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64, "block_size": 16,
            "ingress_num_replicas": 1}  # one ingress on any host: its channel carries every stream
    with serve_app(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from tandem.workers.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama)


def greedy(client, prompt, max_tokens=16, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def group_stats() -> GroupStats:
    return group_handle().stats.remote().result()


# ---- the happy paths -----------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.owned_by == "tandem"


def test_completion_text_and_usage(client, tokenizer):
    prompt = "The quick brown fox"
    out = greedy(client, prompt, max_tokens=12)
    [choice] = out.choices
    num_prompt = len(tokenizer(prompt).input_ids)
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert out.model == MODEL and out.object == "text_completion" and out.id.startswith("cmpl-")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
           (num_prompt, 12, num_prompt + 12)
    assert greedy(client, prompt, max_tokens=12).choices[0].text == choice.text  # greedy is deterministic


def test_prompt_forms_strings_and_token_ids(client, tokenizer):
    ids = tokenizer("Once upon a time").input_ids
    by_text = greedy(client, "Once upon a time", max_tokens=6).choices[0].text
    assert greedy(client, ids, max_tokens=6).choices[0].text == by_text
    out = greedy(client, ["Once upon a time", "It was the best"], max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == by_text
    assert out.choices[1].text == greedy(client, "It was the best", max_tokens=6).choices[0].text
    both = greedy(client, [ids, ids[:3]], max_tokens=6)
    assert both.choices[0].text == by_text
    assert both.usage.prompt_tokens == len(ids) + 3 and both.usage.completion_tokens == 12


def test_echo_returns_the_prompt_first(client):
    out = greedy(client, "Hello there", max_tokens=5, echo=True)
    plain = greedy(client, "Hello there", max_tokens=5)
    assert out.choices[0].text == "Hello there" + plain.choices[0].text


def test_chat_uses_the_models_chat_template(client, tokenizer):
    from tandem.workers.text.tokenizer import apply_chat_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    [choice] = out.choices
    expected_prompt = tokenizer(apply_chat_template(tokenizer, messages), add_special_tokens=False).input_ids
    assert choice.message.role == "assistant" and choice.message.content
    assert out.object == "chat.completion" and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected_prompt), 10)
    # The same prompt through /v1/completions gives the same greedy text.
    assert greedy(client, expected_prompt, max_tokens=10).choices[0].text == choice.message.content
    # max_completion_tokens is the newer name for max_tokens.
    newer = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0)
    assert newer.usage.completion_tokens <= 3


def test_streaming_completion_with_usage(client):
    whole = greedy(client, "Streaming works", max_tokens=20).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="Streaming works", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 20
    assert usage.total_tokens == usage.prompt_tokens + 20


def test_streaming_chat_with_usage(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_tokens_stream_as_they_are_produced(server):
    """The first token reaches the client well before the last one is generated."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    arrivals = []
    with requests.post(f"{server}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    first, last = arrivals[0] - start, arrivals[-1] - start
    assert len(arrivals) > 50
    assert first < 0.5 * last, (first, last)


def test_concurrent_streams_share_the_channel_and_each_gets_exactly_its_answer(server):
    """16 streams at once over the ingress's one channel to the group: each joined stream equals
    the same request answered whole: text per choice (n = 2, seeded), a stop string that may
    fall across chunks, logprobs in order; and the group's flushes carried several deltas each."""

    def body(i: int, stream: bool) -> dict:
        b = {"model": MODEL, "prompt": f"Stream number {i} says", "max_tokens": 12 + i % 5, "temperature": 1.0,
             "seed": i, "n": 2, "logprobs": 2, "ignore_eos": True, "stream": stream}
        if i % 3 == 0:
            b["stop"] = [" the", "e"]
        return b

    def whole(i: int) -> dict:
        r = requests.post(f"{server}/v1/completions", json=body(i, False), headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return {c["index"]: (c["text"], c["logprobs"]["tokens"], c["finish_reason"]) for c in r.json()["choices"]}

    def streamed(i: int) -> dict:
        got: dict[int, tuple[str, list, str | None]] = {0: ("", [], None), 1: ("", [], None)}
        with requests.post(f"{server}/v1/completions", json=body(i, True), headers=AUTH, stream=True,
                           timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                [c] = json.loads(line[6:])["choices"]
                text, tokens, _ = got[c["index"]]
                got[c["index"]] = (text + c["text"], tokens + (c["logprobs"] or {}).get("tokens", []),
                                   c["finish_reason"])
        return got

    expected = [whole(i) for i in range(16)]
    before = group_stats()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(streamed, range(16)))
    after = group_stats()
    assert answers == expected
    flushes, deltas = after.channel_flushes - before.channel_flushes, after.channel_deltas - before.channel_deltas
    assert 0 < flushes < deltas, (flushes, deltas)


def test_n_choices(client):
    out = client.completions.create(model=MODEL, prompt="Pick one", max_tokens=8, n=2, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt="Pick one", max_tokens=8, n=2, temperature=1.0,
                                            seed=3, stream=True, extra_body={"ignore_eos": True}))
    for c in out.choices:  # streamed choices are the same seeded samples
        assert "".join(k.choices[0].text for k in chunks if k.choices[0].index == c.index) == c.text
    assert sum(1 for k in chunks if k.choices[0].finish_reason) == 2  # one finish per choice


def test_stop_string_ends_the_text_before_it(client):
    text = greedy(client, "A serving system", max_tokens=24).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    out = greedy(client, "A serving system", max_tokens=24, stop=[stop, "never-there"])
    [choice] = out.choices
    assert choice.text == text[:text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_completion_logprobs(client):
    out = greedy(client, "Numbers like", max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy takes the most likely token


def test_echo_with_logprobs_scores_the_prompt_tokens_too(client, tiny_llama):
    import torch

    from tests.conftest import hf_logits

    prompt = [17, 230, 61, 99, 145, 8, 77, 190, 33, 54, 120, 71]
    out = greedy(client, prompt, max_tokens=4, echo=True, logprobs=2)
    [choice] = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    ref = torch.log_softmax(hf_logits(tiny_llama, prompt).float(), dim=-1)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert 1 <= len(lp.top_logprobs[i]) <= 3
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # Streamed: the echo chunk carries the prompt's logprobs, then the tokens follow.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert t.bytes == list(t.token.encode())


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Random words:", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1234), sample(1), sample(2)}) > 1


def test_sampling_options_are_accepted(client):
    out = client.completions.create(
        model=MODEL, prompt="Options", max_tokens=5, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=1, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True})
    assert out.usage.completion_tokens == 5


# ---- errors ----------------------------------------------------------------------------------------
def _post(server, path, body, headers=AUTH):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(f"{server}{path}", data=data, headers={"Content-Type": "application/json", **headers},
                         timeout=30)


COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (path, body, status, param)
    (COMPLETION, '{"model": "tiny", "prompt": ', 400, None),  # invalid JSON
    (COMPLETION, "[1, 2]", 400, None),  # not an object
    (COMPLETION, {"model": MODEL, "prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMPLETION, {"model": MODEL, "prompt": 5}, 400, "prompt"),
    (COMPLETION, {"model": MODEL}, 400, "prompt"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "stop": 3}, 400, "stop"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (COMPLETION, {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    (COMPLETION, {"model": MODEL, "prompt": [7] * MAX_MODEL_LEN, "max_tokens": 1}, 400, "prompt"),
    (COMPLETION, {"model": MODEL, "prompt": [10, 100000]}, 400, "prompt"),
    (COMPLETION, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_completion_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MSGS, "logprobs": 3}, 400, "logprobs"),
    (COMPLETION, {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    (CHAT, {"model": "gpt-4", "messages": MSGS}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{s}-{p}" for i, (_, _, s, p) in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_status_and_openai_error_body(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_missing_or_wrong_api_key_is_401(server, headers):
    r = _post(server, COMPLETION, {"model": MODEL, "prompt": "x"}, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{server}/v1/models", headers=headers, timeout=30).status_code == 401


def test_openai_client_raises_the_matching_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="bad", max_retries=0).models.list()


# The hostile-input battery's cases that hold whatever the context and key (tests/serve/hostile_cases.py).
HOSTILE = [c for c in HTTP_CASES if not c.name.startswith("key:") and c.status != 413
           and "context" not in c.name and "too long" not in c.name]


def test_hostile_inputs_get_their_4xx_from_the_real_server(server):
    assert len(HOSTILE) == 101
    for case in HOSTILE:
        body = json.dumps(case.body).encode() if isinstance(case.body, dict) else case.body
        headers = {"Content-Type": "application/json", **case.headers, **AUTH}
        r = requests.request(case.method, f"{server}{case.path}", data=body, headers=headers, timeout=30)
        assert r.status_code == case.status, (case.name, r.text[:300])
        error = r.json()["error"]
        assert sorted(error) == ["code", "message", "param", "type"] and error["message"], case.name
        assert (error["param"], error["code"] if case.code else None) == (case.param, case.code), case.name
        assert "Traceback" not in r.text and ".py" not in r.text, case.name


def test_server_still_serves_after_bad_requests(server, client):
    for path, body, _, _ in BAD_REQUESTS:
        _post(server, path, body)
    assert requests.get(f"{server}/health", timeout=30).status_code == 200  # no key needed
    assert greedy(client, "Still alive?", max_tokens=4).usage.completion_tokens == 4
    stats = group_stats()
    assert stats.routing.is_healthy and stats.kv_blocks_free == stats.kv_blocks_total


# ---- disconnects -------------------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_every_block(server):
    idle = group_stats()
    assert idle.routing.num_running == 0 and idle.kv_blocks_free == idle.kv_blocks_total
    body = {"model": MODEL, "prompt": [11] * 50, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    r = requests.post(f"{server}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60)
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: {"))
    busy = group_stats()
    assert busy.routing.num_running == 1 and busy.kv_blocks_free < busy.kv_blocks_total
    r.close()  # the client goes away mid-stream

    def all_free():
        s = group_stats()
        return s if s.routing.num_running == 0 and s.routing.num_waiting == 0 \
            and s.kv_blocks_free == s.kv_blocks_total else None

    assert wait_for(all_free, timeout_s=20), group_stats()
    assert group_stats().routing.num_aborted_total == idle.routing.num_aborted_total + 1  # aborted, not finished


def test_a_request_sent_on_the_channel_is_aborted_when_its_client_leaves(server):
    """With one group, a streamed request goes on the ingress's open channel to it, not as a
    Serve call; a client that leaves aborts it there all the same."""
    assert wait_for(lambda: group_stats().channels_open == 0, timeout_s=20)  # idle: the channel closed
    idle = group_stats()
    body = {"model": MODEL, "prompt": [11] * 50, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}

    def first_token(r):
        return next(line for line in r.iter_lines() if line.startswith(b"data: {"))

    # Sent on a call (no channel is open); its deltas come on the channel it opens, which stays
    # open while it runs and for a second after.
    holder = requests.post(f"{server}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60)
    holder_lines = holder.iter_lines()
    assert next(line for line in holder_lines if line.startswith(b"data: {"))
    r = requests.post(f"{server}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60)
    assert json.loads(first_token(r)[len(b"data: "):])["choices"][0]["text"]
    assert group_stats().channel_requests == idle.channel_requests + 1  # r went on the channel
    r.close()  # its client goes away mid-stream
    assert [line for line in holder_lines if line][-1] == b"data: [DONE]"  # read to its end: not aborted

    def all_free():
        s = group_stats()
        return s if s.routing.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total else None

    assert wait_for(all_free, timeout_s=20), group_stats()
    assert group_stats().routing.num_aborted_total == idle.routing.num_aborted_total + 1
