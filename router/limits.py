"""RequestLimits and the request body reader that enforces them, before any model work.

    Content-Length or bytes read > max_body_bytes   413, without reading the rest
    the replica's bodies past max_body_bytes_in_flight  429, without reading the rest (body_budget.py)
    a Content-Type that is not JSON                 415 (none at all is taken as JSON)
    not UTF-8, not JSON, NaN / Infinity literals    400 invalid_json
    nesting deeper than max_json_depth              400 (json's own recursion never runs out)
    more than MAX_JSON_CONTAINERS arrays and objects  400, before parsing (json.loads of a few
                                                    million holds the GIL for a second)
    a string with an unpaired surrogate (\\ud800)    400: it is no text, and no tokenizer takes it
    not an object                                   400

Counts within the body (prompts, stop strings, n, logprobs...) are bounds on the pydantic
models in protocol.py, so that the published schema shows them too; the context-length
rules need the tokens and live in EngineClient.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from tandem.router.body_budget import BodyBudget
from tandem.router.protocol import MAX_LOGPROBS, MAX_N, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, OpenAIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# Arrays and objects in one body. A legitimate one holds hundreds (messages, content parts,
# prompts of token ids, tool schemas; 2,048 messages of two content parts are 8,192); an 8 MiB
# body of empty arrays holds 2.8 million, whose parse alone holds the GIL, and with it every
# stream of the replica, for 0.8 s here. At this bound a body under PARSE_ON_THREAD_BYTES,
# parsed on the loop, holds it for ~12 ms at most.
MAX_JSON_CONTAINERS = 16_384
# Parsing and checking a text body costs about 1.6 ms a MiB here (json's parse, the bracket
# count, the surrogate scan: C calls that each hold the GIL). From this size on it runs on a
# thread, so the event loop (every stream this replica serves) gets its turns between those
# calls instead of waiting for all of them.
PARSE_ON_THREAD_BYTES = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    # All the bodies one ingress replica reads at once; None: 32 of the largest (256 MiB by default).
    max_body_bytes_in_flight: int | None = None
    max_json_depth: int = 32  # the deepest legitimate body (chat content parts) is 4
    # The work one request may ask for, the same over HTTP and gRPC (the HTTP schema's own
    # bounds, MAX_N and MAX_LOGPROBS, are the most a server may allow): samples per prompt,
    # alternatives per position (output and prompt logprobs), and sequences in all (prompts x
    # n), which is what the engine runs and what admission charges.
    max_n: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_sequences_per_request: int = 256

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if self.body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(f"max_request_body_bytes_in_flight: must be >= max_request_body_bytes "
                             f"({self.max_body_bytes}), got {self.max_body_bytes_in_flight}")
        if self.max_json_depth < 4:
            raise ValueError(f"max_json_depth: must be >= 4, got {self.max_json_depth}")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n: must be in [1, {MAX_N}], got {self.max_n}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs: must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request: must be >= 1, got {self.max_sequences_per_request}")

    @property
    def body_bytes_in_flight(self) -> int:
        if self.max_body_bytes_in_flight is None:
            return 32 * self.max_body_bytes
        return self.max_body_bytes_in_flight

    def sequences(self, n: int, num_prompts: int, logprobs: int | None = None,
                  logprobs_field: str = "logprobs") -> int:
        """The sequences a request of `num_prompts` prompts x `n` samples runs (admission's
        cost), once its counts are within this server's bounds; ValueError names the field."""
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        if n > self.max_n:
            raise ValueError(f"n: at most {self.max_n} samples per prompt on this server, got {n}")
        if n * num_prompts > self.max_sequences_per_request:
            raise ValueError(f"n: prompts x n may be at most {self.max_sequences_per_request} sequences per "
                             f"request on this server, got {num_prompts} x {n}")
        if logprobs is not None and logprobs > self.max_logprobs:
            raise ValueError(f"{logprobs_field}: at most {self.max_logprobs} alternatives per position on this "
                             f"server, got {logprobs}")
        return n * num_prompts


async def read_json_object(request: Request, limits: RequestLimits, budget: BodyBudget) -> dict[str, Any]:
    """The request's JSON object body, or an OpenAIError saying what is wrong with it; its
    bytes count against `budget` until it is parsed."""
    _check_content_type(request.headers.get("content-type"))
    with budget.hold() as take:
        body = await _read_bounded(request, limits.max_body_bytes, take)
        if len(body) >= PARSE_ON_THREAD_BYTES:
            return await _parse_on_thread(body, limits.max_json_depth)
        return parse_json_object(body, limits.max_json_depth)


async def _parse_on_thread(body: bytes, max_depth: int) -> dict[str, Any]:
    parsing = asyncio.get_running_loop().run_in_executor(None, parse_json_object, body, max_depth)
    try:
        return await asyncio.shield(parsing)
    except asyncio.CancelledError:
        # The request was cancelled (its client left), but the thread goes on with the body:
        # its bytes stay counted against the budget until the thread lets them go.
        await asyncio.wait([parsing])
        if not parsing.cancelled():
            parsing.exception()  # retrieved: the request is gone, its error with it
        raise


def parse_json_object(body: bytes, max_depth: int, max_containers: int = MAX_JSON_CONTAINERS) -> dict[str, Any]:
    # Counting brackets is C-fast; strings' brackets count too, so a count past a bound is
    # checked again without them.
    brackets = body.count(b"[") + body.count(b"{")
    if brackets > max_containers and _containers(body) > max_containers:
        raise OpenAIError(400, f"the request body holds more than {max_containers} JSON arrays and objects",
                          code="invalid_json")
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise OpenAIError(400, f"invalid JSON body: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    # The count bounds the depth: walk the tree only when it could be deep (the walk looks at
    # every item of every list: 0.2 s for a list of 4M token ids).
    if brackets > max_depth and _depth(value, max_depth) > max_depth:
        raise _too_deep(max_depth)
    if _SURROGATE_ESCAPE.search(body):
        path = _unpaired_surrogate(value, "")
        if path is not None:
            head = path.split(".")[0].split("[")[0]
            raise OpenAIError(400, f"{path or 'body'}: a string holds an unpaired UTF-16 surrogate (not valid "
                              "Unicode text)", param=head if head.isascii() and head.isidentifier() else None,
                              code="invalid_utf8")
    return value


def _check_content_type(content_type: str | None) -> None:
    if content_type is None:
        return  # curl without -H and many scripts: the body decides
    media = content_type.split(";")[0].strip().lower()
    if media not in ("application/json", "") and not media.endswith("+json"):
        raise OpenAIError(415, f"unsupported content type {media!r}: send 'Content-Type: application/json'",
                          code="unsupported_media_type")


async def _read_bounded(request: Request, max_bytes: int, take: Callable[[int], None]) -> bytes:
    declared = request.headers.get("content-length")
    taken = 0
    if declared is not None and declared.isdigit():
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
        taken = int(declared)
        take(taken)  # all of it before any is read
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # a chunked body has no length up front
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            if size > taken:
                take(size - taken)
                taken = size
            chunks.append(chunk)
    except ClientDisconnect:
        raise OpenAIError(400, "the client closed the connection before the body ended",
                          code="invalid_json") from None
    return b"".join(chunks)


def _containers(body: bytes) -> int:
    """The '[' and '{' of a JSON text outside its strings, in C-speed passes: without its escaped
    backslashes and quotes, every other piece between two quotes is outside a string."""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(plain.split(b'"')[::2])
    return outside.count(b"[") + outside.count(b"{")


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes",
                       code="request_too_large")


def _too_deep(max_depth: int) -> OpenAIError:
    return OpenAIError(400, f"the request body nests more than {max_depth} levels deep", code="invalid_json")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of `value`, counted up to limit + 1 (iterative: a deep body cannot recurse us out)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _unpaired_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) that is not encodable text, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        child_path = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
        found = _unpaired_surrogate(key, child_path.lstrip(".")) if isinstance(key, str) else None
        found = found if found is not None else _unpaired_surrogate(child, child_path.lstrip("."))
        if found is not None:
            return found
    return None


def check_stop_counts(stop: list[str], num_stop_token_ids: int) -> None:
    """The bounds protocol.py puts on the HTTP fields, for the gRPC request (ValueError names the field)."""
    if len(stop) > MAX_STOP:
        raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(stop)}")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
    if num_stop_token_ids > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {num_stop_token_ids}")
