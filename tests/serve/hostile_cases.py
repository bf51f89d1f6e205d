"""The hostile-input battery's table: bad requests and the exact answer each must get.

A case is a request (method, path, JSON body or raw bytes, headers) and the status,
`error.param` and `error.code` the server must answer with. Bodies are written against
a server with MAX_MODEL_LEN = 64 tokens and a 512-token vocabulary (the tiny test model).
gRPC cases are GenerateRequests with the status code they must end with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.router import tandem_pb2 as pb

API_KEY = "sesame"
AUTH = {"authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL, CHAT_PATH = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class HttpCase:
    name: str
    status: int
    param: str | None = None
    code: str | None = None
    body: Any = None  # a dict (sent as JSON), bytes (sent as is) or None (no body)
    path: str = CMPL
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    message_has: str | None = None


def completion(name: str, status: int, param: str | None, code: str | None = None, *, drop: tuple[str, ...] = (),
               message_has: str | None = None, **fields: Any) -> HttpCase:
    body = {k: v for k, v in {**COMPLETION, **fields}.items() if k not in drop}
    return HttpCase(f"completions: {name}", status, param, code, body, message_has=message_has)


def chat(name: str, status: int, param: str | None, code: str | None = None, *, drop: tuple[str, ...] = (),
         message_has: str | None = None, **fields: Any) -> HttpCase:
    body = {k: v for k, v in {**CHAT, **fields}.items() if k not in drop}
    return HttpCase(f"chat: {name}", status, param, code, body, path=CHAT_PATH, message_has=message_has)


def raw(name: str, status: int, body: bytes, code: str | None, path: str = CMPL, param: str | None = None,
        **headers: str) -> HttpCase:
    return HttpCase(f"body: {name}", status, param, code, body, path=path,
                    headers={"content-type": "application/json", **headers})


def _nested(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


def _padded(body: bytes) -> bytes:
    """`body` (a JSON object's text) with a 2 MiB "pad" string first."""
    return b'{"pad": "' + b"p" * (2 << 20) + b'", ' + body[1:]


BIG = 8 * 1024 * 1024 + 1  # one byte over the default max_request_body_bytes
HTTP_CASES: list[HttpCase] = [
    # ---- /v1/completions: every field ---------------------------------------------------------
    completion("prompt missing", 400, "prompt", "missing_required_parameter", drop=("prompt",)),
    completion("prompt null", 400, "prompt", prompt=None),
    completion("prompt a number", 400, "prompt", prompt=5),
    completion("prompt an object", 400, "prompt", prompt={"text": "hi"}),
    completion("prompt empty list", 400, "prompt", "invalid_value", prompt=[]),
    completion("prompt list of empty list", 400, "prompt", "invalid_value", prompt=[[]]),
    completion("prompt mixed strings and ids", 400, "prompt", prompt=["a", 1]),
    completion("prompt negative token id", 400, "prompt", prompt=[-1]),
    completion("prompt token id outside the vocabulary", 400, "prompt", "invalid_value", prompt=[100000],
               message_has="outside the vocabulary [0, 512)"),
    completion("prompt token id a float", 400, "prompt", prompt=[1.5]),
    completion("prompt token id beyond int32", 400, "prompt", prompt=[2**40]),
    completion("prompt token id a bool", 400, "prompt", prompt=[True]),
    completion("prompt too long (ids)", 400, "prompt", "invalid_value", prompt=[5] * 64,
               message_has="maximum context length is 64 tokens, but the prompt has 64"),
    completion("prompt too long (text)", 400, "prompt", "invalid_value", prompt="hello " * 200,
               message_has="maximum context length is 64 tokens"),
    completion("too many prompts", 400, "prompt", "invalid_value", prompt=["a"] * 129, message_has="128"),
    completion("max_tokens zero", 400, "max_tokens", "invalid_value", max_tokens=0),
    completion("max_tokens negative", 400, "max_tokens", "invalid_value", max_tokens=-1),
    completion("max_tokens a string", 400, "max_tokens", "invalid_type", max_tokens="16"),
    completion("max_tokens a float", 400, "max_tokens", "invalid_type", max_tokens=8.5),
    completion("max_tokens beyond the context", 400, "max_tokens", "invalid_value", max_tokens=100,
               message_has="maximum context length is 64 tokens; the prompt has 3 and max_tokens asks for 100 more"),
    completion("max_tokens beyond int32", 400, "max_tokens", "invalid_value", max_tokens=2**31),
    completion("temperature negative", 400, "temperature", "invalid_value", temperature=-0.1),
    completion("temperature above 2", 400, "temperature", "invalid_value", temperature=2.5),
    completion("temperature a string", 400, "temperature", "invalid_type", temperature="hot"),
    completion("top_p zero", 400, "top_p", "invalid_value", top_p=0),
    completion("top_p above 1", 400, "top_p", "invalid_value", top_p=1.5),
    completion("top_k below -1", 400, "top_k", "invalid_value", top_k=-2),
    completion("min_p above 1", 400, "min_p", "invalid_value", min_p=2),
    completion("presence_penalty above 2", 400, "presence_penalty", "invalid_value", presence_penalty=3),
    completion("frequency_penalty below -2", 400, "frequency_penalty", "invalid_value", frequency_penalty=-3),
    completion("repetition_penalty zero", 400, "repetition_penalty", "invalid_value", repetition_penalty=0),
    # Dividing logits by 1e-30 overflows float32 (NaN probabilities: a failed group step).
    completion("repetition_penalty tiny", 400, "repetition_penalty", "invalid_value", repetition_penalty=1e-30),
    completion("repetition_penalty huge", 400, "repetition_penalty", "invalid_value", repetition_penalty=1e30),
    completion("n zero", 400, "n", "invalid_value", n=0),
    completion("n above 128", 400, "n", "invalid_value", n=129),
    # 128 prompts x n = 128 would be 16,384 sequences for one request: over the 256 allowed.
    completion("prompts x n over the sequences per request", 400, "n", "invalid_value", n=128,
               prompt=[[5, 6]] * 128, message_has="at most 256 sequences per request on this server, got 128 x 128"),
    completion("prompts x n one over the sequences per request", 400, "n", "invalid_value", n=3,
               prompt=[[5, 6]] * 86, message_has="got 86 x 3"),
    completion("n a bool", 400, "n", "invalid_type", n=True),
    completion("best_of other than n", 400, "best_of", "invalid_value", best_of=2),
    completion("best_of zero", 400, "best_of", "invalid_value", best_of=0),
    completion("logprobs above 20", 400, "logprobs", "invalid_value", logprobs=21),
    completion("logprobs negative", 400, "logprobs", "invalid_value", logprobs=-1),
    completion("17 stop strings", 400, "stop", "invalid_value", stop=[str(i) for i in range(17)]),
    completion("stop string of 2000 characters", 400, "stop", stop="x" * 2000),
    completion("stop a list of numbers", 400, "stop", stop=[1, 2]),
    completion("300 stop_token_ids", 400, "stop_token_ids", "invalid_value", stop_token_ids=list(range(300))),
    completion("stop_token_ids negative", 400, "stop_token_ids", "invalid_value", stop_token_ids=[-1]),
    completion("seed beyond int64", 400, "seed", "invalid_value", seed=2**64),
    completion("seed a string", 400, "seed", "invalid_type", seed="x"),
    completion("echo a string", 400, "echo", "invalid_type", echo="yes"),
    completion("stream a string", 400, "stream", "invalid_type", stream="true"),
    completion("stream_options a string", 400, "stream_options", stream_options="x"),
    completion("stream_options.include_usage a string", 400, "stream_options", "invalid_type",
               stream_options={"include_usage": "yes"}),
    completion("model unknown", 404, "model", "model_not_found", model="gpt-4"),
    completion("model a number", 400, "model", "invalid_type", model=5),
    completion("min_tokens negative", 400, "min_tokens", "invalid_value", min_tokens=-1),
    completion("ignore_eos a number", 400, "ignore_eos", "invalid_type", ignore_eos=1),
    completion("user a number", 400, "user", "invalid_type", user=5),
    completion("extra field nested too deep", 400, None, "invalid_json",
               extra=json.loads(b"[" * 40 + b"]" * 40)),
    # ---- /v1/chat/completions -----------------------------------------------------------------
    chat("messages missing", 400, "messages", "missing_required_parameter", drop=("messages",)),
    chat("messages empty", 400, "messages", "invalid_value", messages=[]),
    chat("messages a string", 400, "messages", messages="hi"),
    chat("message without role", 400, "messages", messages=[{"content": "hi"}]),
    chat("message with an unknown role", 400, "messages", messages=[{"role": "robot", "content": "hi"}]),
    chat("message content a number", 400, "messages", messages=[{"role": "user", "content": 5}]),
    chat("content part of another type", 400, "messages",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    chat("content part without text", 400, "messages", messages=[{"role": "user", "content": [{"type": "text"}]}]),
    chat("1025 messages", 400, "messages", "invalid_value", messages=[{"role": "user", "content": "a"}] * 1025),
    chat("max_completion_tokens zero", 400, "max_completion_tokens", "invalid_value", max_completion_tokens=0),
    chat("max_completion_tokens beyond the context", 400, "max_tokens", "invalid_value", max_completion_tokens=500,
         message_has="maximum context length is 64 tokens"),
    chat("top_logprobs above 20", 400, "top_logprobs", "invalid_value", logprobs=True, top_logprobs=21),
    chat("top_logprobs without logprobs", 400, "top_logprobs", "invalid_value", top_logprobs=2),
    chat("logprobs a string", 400, "logprobs", "invalid_type", logprobs="yes"),
    chat("messages too long for the context", 400, "messages", "invalid_value",
         messages=[{"role": "user", "content": "hello " * 100}], message_has="maximum context length is 64"),
    chat("unpaired surrogate in content", 400, "messages", "invalid_utf8",
         messages=[{"role": "user", "content": "\ud800"}]),
    # ---- bodies -------------------------------------------------------------------------------
    raw("truncated object", 400, b'{"model": "tiny", "prompt": "hel', "invalid_json"),
    raw("truncated after a comma", 400, b'{"prompt": "hi",', "invalid_json"),
    raw("empty", 400, b"", "invalid_json"),
    raw("an array", 400, b'["hi"]', "invalid_json"),
    raw("a string", 400, b'"hi"', "invalid_json"),
    raw("null", 400, b"null", "invalid_json"),
    raw("invalid UTF-8", 400, b'{"prompt": "\xff\xfe\xfd"}', "invalid_json"),
    raw("overlong UTF-8 encoding", 400, b'{"prompt": "\xc0\xaf"}', "invalid_json"),
    raw("NaN literal", 400, b'{"prompt": "hi", "temperature": NaN}', "invalid_json"),
    raw("Infinity literal", 400, b'{"prompt": "hi", "temperature": Infinity}', "invalid_json"),
    raw("number overflowing to infinity", 400, b'{"prompt": "hi", "temperature": 1e999}', "invalid_type",
        param="temperature"),
    raw("integer of 5000 digits", 400, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    raw("nested 100 deep", 400, _nested(100), "invalid_json"),
    raw("nested 100000 deep", 400, _nested(100_000), "invalid_json"),
    raw("unpaired surrogate escape in prompt", 400, b'{"prompt": "a\\udc00b"}', "invalid_utf8", param="prompt"),
    raw("unpaired surrogate in a key", 400, b'{"prompt": "hi", "\\ud800": 1}', "invalid_utf8"),
    # From 1 MiB on a body is parsed on a thread (router/limits.py): the same answers.
    raw("2 MiB nested 100 deep", 400, _padded(_nested(100)), "invalid_json"),
    raw("2 MiB with an unpaired surrogate escape", 400, _padded(b'{"prompt": "a\\udc00b"}'), "invalid_utf8",
        param="prompt"),
    raw("2 MiB not JSON", 400, _padded(b'{"prompt": "hi",}'), "invalid_json"),
    raw("100,000 empty arrays", 400, b'{"prompt": "hi", "x": [' + b"[]," * 100_000 + b"[]]}", "invalid_json"),
    raw("larger than the limit", 413, b'{"prompt": "' + b"a" * BIG + b'"}', "request_too_large"),
    raw("content type text/html", 415, json.dumps(COMPLETION).encode(), "unsupported_media_type",
        **{"content-type": "text/html"}),
    raw("content type form-urlencoded", 415, b"prompt=hi", "unsupported_media_type",
        **{"content-type": "application/x-www-form-urlencoded"}),
    raw("content type multipart", 415, b"--x--", "unsupported_media_type",
        **{"content-type": "multipart/form-data; boundary=x"}),
    raw("chat body truncated", 400, b'{"messages": [{"role": "user", "content": "h', "invalid_json", path=CHAT_PATH),
    # ---- methods, paths, keys -----------------------------------------------------------------
    HttpCase("method: GET /v1/completions", 405, None, None, method="GET"),
    HttpCase("method: PUT /v1/chat/completions", 405, None, None, CHAT, path=CHAT_PATH, method="PUT"),
    HttpCase("method: DELETE /v1/models", 405, None, None, path="/v1/models", method="DELETE"),
    HttpCase("method: POST /v1/models", 405, None, None, {}, path="/v1/models"),
    HttpCase("method: POST /health", 405, None, None, {}, path="/health"),
    HttpCase("path: /v1/embeddings", 404, None, "not_found", COMPLETION, path="/v1/embeddings"),
    HttpCase("path: /v2/completions", 404, None, "not_found", COMPLETION, path="/v2/completions"),
    HttpCase("key: missing", 401, None, "invalid_api_key", COMPLETION, headers={"authorization": ""}),
    HttpCase("key: wrong", 401, None, "invalid_api_key", COMPLETION, headers={"authorization": "Bearer sesame2"}),
    HttpCase("key: another scheme", 401, None, "invalid_api_key", COMPLETION,
             headers={"authorization": f"Basic {API_KEY}"}),
    HttpCase("key: a prefix of the key", 401, None, "invalid_api_key", COMPLETION,
             headers={"authorization": "Bearer sesam"}),
    HttpCase("key: models without a key", 401, None, "invalid_api_key", path="/v1/models", method="GET",
             headers={"authorization": ""}),
]

# Accepted on purpose: odd but valid (extra fields are ignored, as vLLM does).
ACCEPTED_CASES: list[HttpCase] = [
    completion("unknown extra field", 200, None, frobnicate={"a": [1, 2]}),
    # Scaling logits by 1/1e-40 overflows float32: below 1e-5 a temperature means greedy.
    completion("temperature 1e-40", 200, None, temperature=1e-40),
    completion("emoji, RTL, combining marks and NUL", 200, None, prompt="🙂 שלום e\u0301 \u0000 \u200f"),
    completion("a paired surrogate escape", 200, None, prompt="\ud83d\ude00"),
    chat("content parts", 200, None, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
    HttpCase("body: JSON with a charset", 200, None, None, COMPLETION,
             headers={"content-type": "application/json; charset=utf-8"}),
    HttpCase("body: no content type", 200, None, None, json.dumps(COMPLETION).encode()),
]


@dataclass(frozen=True)
class GrpcCase:
    name: str
    code: grpc.StatusCode
    request: pb.GenerateRequest
    metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {API_KEY}"),)
    details_has: str = ""


def _generate(name: str, code: grpc.StatusCode, details_has: str = "", prompt: list[int] | None = None,
              **sampling: Any) -> GrpcCase:
    ids = pb.TokenIds(ids=[5, 6, 7] if prompt is None else prompt)
    request = pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(**sampling))
    return GrpcCase(f"grpc: {name}", code, request, details_has=details_has)


BAD = grpc.StatusCode.INVALID_ARGUMENT
GRPC_CASES: list[GrpcCase] = [
    GrpcCase("grpc: no prompt", BAD, pb.GenerateRequest(), details_has="prompt"),
    _generate("empty token ids", BAD, "prompt", prompt=[]),
    _generate("token id outside the vocabulary", BAD, "prompt", prompt=[600]),
    _generate("token id at uint32 max", BAD, "prompt", prompt=[2**32 - 1]),
    _generate("prompt too long", BAD, "maximum context length is 64", prompt=[5] * 64),
    GrpcCase("grpc: text too long", BAD, pb.GenerateRequest(text="hello " * 200), details_has="prompt"),
    _generate("max_tokens zero", BAD, "max_tokens", max_tokens=0),
    _generate("max_tokens beyond the context", BAD, "max_tokens", max_tokens=100),
    _generate("max_tokens at uint32 max", BAD, "max_tokens", max_tokens=2**32 - 1),
    _generate("temperature negative", BAD, "temperature", temperature=-1.0),
    _generate("temperature NaN", BAD, "temperature", temperature=float("nan")),
    _generate("temperature infinite", BAD, "temperature", temperature=float("inf")),
    _generate("top_p zero", BAD, "top_p", top_p=0.0),
    _generate("top_p above 1", BAD, "top_p", top_p=2.0),
    _generate("top_k below -1", BAD, "top_k", top_k=-5),
    _generate("min_p above 1", BAD, "min_p", min_p=1.5),
    _generate("n zero", BAD, "n", n=0),
    # uint32: each sample is a sequence, built before any step; one such request used to take
    # its group's memory and GIL, then (nothing yielded) be retried on another group.
    _generate("n at uint32 max", BAD, "n: at most 128 samples per prompt on this server, got 4294967295",
              n=2**32 - 1),
    _generate("n above 128", BAD, "n: at most 128", n=129),
    _generate("n 128 is fine but 257 is not", BAD, "n: at most 128", n=257),
    _generate("presence_penalty above 2", BAD, "presence_penalty", presence_penalty=5.0),
    _generate("repetition_penalty zero", BAD, "repetition_penalty", repetition_penalty=0.0),
    _generate("repetition_penalty tiny", BAD, "repetition_penalty: must be in [0.01, 100]", repetition_penalty=1e-30),
    _generate("logprobs above 20", BAD, "logprobs", logprobs=21),
    _generate("logprobs at uint32 max", BAD, "logprobs: at most 20 alternatives", logprobs=2**32 - 1),
    _generate("17 stop strings", BAD, "stop", stop=[str(i) for i in range(17)]),
    _generate("stop string of 2000 characters", BAD, "stop", stop=["x" * 2000]),
    _generate("300 stop_token_ids", BAD, "stop_token_ids", stop_token_ids=list(range(300))),
    GrpcCase("grpc: unknown model", grpc.StatusCode.NOT_FOUND, pb.GenerateRequest(model="gpt-4", text="hi")),
    GrpcCase("grpc: no key", grpc.StatusCode.UNAUTHENTICATED, pb.GenerateRequest(text="hi"), metadata=()),
    GrpcCase("grpc: wrong key", grpc.StatusCode.UNAUTHENTICATED, pb.GenerateRequest(text="hi"),
             metadata=(("authorization", "Bearer sesame2"),)),
]
