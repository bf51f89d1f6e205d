"""The request mix of `tandem bench soak`: seeded, so a run can be repeated request for request.

Every valid request is greedy with `ignore_eos` (its output is fixed, so it can be checked
against the offline engine) and carries the server-side `timeout` (so the server aborts it
before the client would give up). Prompts are one of a few shared prefixes plus a suffix of
their own. Of all requests:

    invalid_share   a bad request from a fixed table (wrong types, out of range, unknown
                    model, broken JSON, too long for the context), HTTP and gRPC
    abandon_share   a streaming request whose client leaves after its first few chunks
    grpc_share      sent over gRPC (when the server has a gRPC port), else HTTP
    stream_share    streamed (abandoning ones always are)
    chat_share      of HTTP requests: chat completions instead of completions (not checked)
    long_share      of valid completions: a prompt that fills the context but for the request's
                    own tokens (the soak's server sizes its KV cache so that a few of these
                    force preemptions)
    slow_share      of valid streamed requests: a client that reads slowly (SLOW_READ_S between
                    chunks), which the server must neither stall on nor cut off
    hostile_share   of valid requests: what a careless or hostile client sends and the server
                    must serve unharmed: a temperature of 1e-40 (greedy, so still checked)
                    over HTTP, a shared or sample-like client id ("dup", "x#1") over gRPC.
                    The invalid tables hold the hostile refusals too (n of 2^32-1, 128
                    prompts x n 128, huge logprobs, a 1e-30 repetition penalty, 10,000 stops).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.workload import NUM_SPECIAL_TOKENS


@dataclass(frozen=True)
class MixSpec:
    num_prefixes: int = 8
    prefix_len: int = 48
    suffix_len: tuple[int, int] = (4, 24)
    output_len: tuple[int, int] = (8, 48)
    invalid_share: float = 0.10
    abandon_share: float = 0.20
    grpc_share: float = 0.30
    stream_share: float = 0.50
    chat_share: float = 0.15
    hostile_share: float = 0.10
    long_share: float = 0.03
    slow_share: float = 0.05
    timeout_s: float = 40.0  # the `timeout` field of every valid request


SLOW_READ_S = 0.05  # a slow client's pause after each chunk it reads


@dataclass(frozen=True)
class SoakRequest:
    index: int
    api: str  # "http" | "grpc"
    stream: bool
    prompt_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 0
    chat: bool = False
    abandon_after: int = 0  # > 0: leave after this many chunks
    invalid: str = ""  # the name of the bad input ("" = a valid request)
    body: Any = None  # HTTP: the JSON (or raw bytes) to send; gRPC: keyword arguments of the request
    hostile: bool = False  # a valid request with a hostile choice in it (see hostile_share)
    slow: bool = False  # streamed, its client pausing SLOW_READ_S after each chunk (see slow_share)

    @property
    def is_hostile(self) -> bool:
        return self.hostile or self.invalid in HOSTILE_INVALID

    @property
    def checkable(self) -> bool:
        """A complete greedy completion whose output the offline engine can reproduce."""
        return not self.invalid and not self.abandon_after and not self.chat


# 300 KB whose parse would hold the ingress's GIL: refused before it (router/limits.py). Built
# once: the table below is made for every invalid request drawn.
_ARRAYS_100K = b'{"prompt": [1], "logit_bias": [' + b"[]," * 100_000 + b"[]]}"


# name -> (HTTP body, or raw bytes; built around a valid prompt)
def _http_invalid(prompt: list[int], max_model_len: int) -> dict[str, Any]:
    return {
        "max_tokens_negative": {"prompt": prompt, "max_tokens": -1},
        "temperature_string": {"prompt": prompt, "temperature": "hot"},
        "top_p_zero": {"prompt": prompt, "top_p": 0.0},
        "prompt_empty": {"prompt": []},
        "prompt_missing": {"max_tokens": 4},
        "unknown_model": {"prompt": prompt, "model": "no-such-model"},
        "token_id_out_of_vocab": {"prompt": [10**9]},
        "prompt_too_long": {"prompt": [NUM_SPECIAL_TOKENS] * (max_model_len + 1)},
        "n_zero": {"prompt": prompt, "n": 0},
        "timeout_negative": {"prompt": prompt, "timeout": -1},
        "broken_json": b'{"prompt": [1, 2',
        "body_not_object": b"[1, 2, 3]",
        "n_huge": {"prompt": prompt, "n": 10**6},
        "n_times_prompts": {"prompt": [prompt] * 128, "n": 128},
        "logprobs_huge": {"prompt": prompt, "logprobs": 10**6},
        "repetition_penalty_tiny": {"prompt": prompt, "repetition_penalty": 1e-30},
        "stop_list_long": {"prompt": prompt, "stop": ["x"] * 10_000},
        "arrays_100k": _ARRAYS_100K,
    }


_GRPC_INVALID = {
    "grpc_prompt_missing": {},
    "grpc_temperature_negative": {"sampling": {"temperature": -1.0}},
    "grpc_unknown_model": {"model": "no-such-model"},
    "grpc_timeout_zero": {"timeout": 0.0},
    "grpc_n_huge": {"sampling": {"n": 2**32 - 1}},
    "grpc_logprobs_huge": {"sampling": {"logprobs": 2**32 - 1}},
    "grpc_repetition_penalty_tiny": {"sampling": {"repetition_penalty": 1e-30}},
    "grpc_stop_list_long": {"sampling": {"stop": ["x"] * 10_000}},
}
# The refusals a hostile client draws (counted in `hostile_requests` with the valid hostile ones).
HOSTILE_INVALID = frozenset({"n_huge", "n_times_prompts", "logprobs_huge", "repetition_penalty_tiny",
                             "stop_list_long", "arrays_100k", "grpc_n_huge", "grpc_logprobs_huge",
                             "grpc_repetition_penalty_tiny", "grpc_stop_list_long"})
# gRPC client ids a hostile or careless client sends: one shared by many, one shaped like a sample id.
HOSTILE_CLIENT_IDS = ("dup", "x#1")
HOSTILE_TEMPERATURE = 1e-40  # greedy on the server (below 1e-5), so the output is still checked


def make_mix(num: int, spec: MixSpec, vocab_size: int, max_model_len: int, *, seed: int, grpc: bool,
             first_index: int = 0, valid_only: bool = False) -> list[SoakRequest]:
    """`num` requests of the mix (`valid_only`: neither invalid nor abandoning ones)."""
    rng = random.Random(seed)
    prefixes = [[random.Random(p).randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(spec.prefix_len)]
                for p in range(spec.num_prefixes)]  # the same prefixes in every phase
    out = []
    for i in range(first_index, first_index + num):
        prompt = rng.choice(prefixes) + [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size)
                                         for _ in range(rng.randint(*spec.suffix_len))]
        max_tokens = rng.randint(*spec.output_len)
        api = "grpc" if grpc and rng.random() < spec.grpc_share else "http"
        roll = rng.random()
        if not valid_only and roll < spec.invalid_share:
            table = _GRPC_INVALID if api == "grpc" else _http_invalid(prompt, max_model_len)
            name = rng.choice(sorted(table))
            out.append(SoakRequest(i, api, rng.random() < spec.stream_share, prompt, max_tokens, invalid=name,
                                   body=table[name]))
            continue
        abandon = not valid_only and roll < spec.invalid_share + spec.abandon_share
        stream = abandon or rng.random() < spec.stream_share
        chat = api == "http" and rng.random() < spec.chat_share
        if not abandon and not chat and rng.random() < spec.long_share:  # the context full but for its output
            prompt = prompt + [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size)
                               for _ in range(max_model_len - max_tokens - rng.randint(0, 8) - len(prompt))]
        out.append(SoakRequest(i, api, stream, prompt, max_tokens, chat=chat,
                               abandon_after=rng.randint(1, 3) if abandon else 0,
                               hostile=rng.random() < spec.hostile_share,
                               slow=stream and not abandon and rng.random() < spec.slow_share))
    return out


def http_request(req: SoakRequest, model: str | None, timeout_s: float) -> tuple[str, Any]:
    """(path, JSON body or raw bytes) of an HTTP request."""
    if req.invalid:
        body = req.body if isinstance(req.body, bytes) else {**({"model": model} if model else {}), **req.body}
        return "/v1/completions", body
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": HOSTILE_TEMPERATURE if req.hostile else 0.0,
                            "ignore_eos": True, "stream": req.stream, "timeout": timeout_s}
    if model:
        body["model"] = model
    if req.chat:
        return "/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": " ".join(str(t) for t in req.prompt_token_ids[-16:])}]}
    return "/v1/completions", {**body, "prompt": req.prompt_token_ids}


def grpc_request(req: SoakRequest, pb: Any, timeout_s: float) -> Any:
    """The GenerateRequest message of a gRPC request (`pb`: the API's message module)."""
    if req.invalid:
        fields = dict(req.body)
        sampling = fields.pop("sampling", {})
        if "model" in fields or "timeout" in fields or sampling:
            fields["token_ids"] = pb.TokenIds(ids=req.prompt_token_ids)
        return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)
    client_id = HOSTILE_CLIENT_IDS[req.index % len(HOSTILE_CLIENT_IDS)] if req.hostile else ""
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=req.prompt_token_ids), timeout=timeout_s, request_id=client_id,
                              sampling=pb.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))
