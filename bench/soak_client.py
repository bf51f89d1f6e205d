"""One soak request over HTTP or gRPC, and what became of it: exactly one outcome each.

    completed         the whole answer (200, every chunk and [DONE]; gRPC OK)
    rejected          turned away before any work: HTTP 429/503, gRPC RESOURCE_EXHAUSTED/
                      UNAVAILABLE (`retry_after` says whether a Retry-After header came)
    failed_clean      ended with an error the client can act on: 408 (its timeout), an SSE
                      error event, a 503 because its group failed, gRPC DEADLINE_EXCEEDED from
                      the server, a 4xx for a request that was valid
    failed_abrupt     the connection broke (no status, no error event, no [DONE])
    lost              nothing at all within the client's deadline
    unexpected_5xx    HTTP 5xx other than 503; gRPC INTERNAL, UNKNOWN or DATA_LOSS
    abandoned         the client left mid-stream on purpose (after its first chunks)
    invalid_answered  a bad request answered with a 4xx and an OpenAI-shaped error body
                      (gRPC INVALID_ARGUMENT or NOT_FOUND)
    invalid_accepted  a bad request the server answered 200 (or with the wrong kind of error)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.load_generator import httpx
from tandem.bench.soak_mix import SLOW_READ_S, SoakRequest, grpc_request, http_request

OUTCOMES = ("completed", "rejected", "failed_clean", "failed_abrupt", "lost", "unexpected_5xx", "abandoned",
            "invalid_answered", "invalid_accepted")
_GROUP_FAILED = "replica group failed"  # in a 503's message: the group died, it was not a rejection


@dataclass
class Outcome:
    request: SoakRequest
    kind: str
    status: str = ""  # "200", "503", "sse_error", "grpc:UNAVAILABLE", ...
    detail: str = ""
    retry_after: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


def _error_message(raw: bytes) -> str | None:
    """The message of an OpenAI-shaped error body, else None."""
    try:
        error = json.loads(raw)["error"]
        return error["message"] if isinstance(error, dict) and isinstance(error.get("message"), str) else None
    except (ValueError, KeyError, TypeError):
        return None


def _http_error(req: SoakRequest, status: int, raw: bytes) -> tuple[str, str]:
    """(outcome, detail) of a non-200 answer."""
    message = _error_message(raw)
    detail = (message or raw[:200].decode(errors="replace"))[:300]
    if status >= 500 and status != 503:
        return "unexpected_5xx", detail
    if status == 503 and message and _GROUP_FAILED in message:
        return "failed_clean", detail
    if status in (429, 503):
        return "rejected", detail
    if req.invalid:
        return ("invalid_answered" if 400 <= status < 500 and message is not None else "invalid_accepted"), detail
    return "failed_clean", detail  # 408 (its own timeout); another 4xx would be a bug, named in detail


async def send_http(client: httpx.AsyncClient, base_url: str, req: SoakRequest, *, model: str | None,
                    timeout_s: float, deadline_s: float) -> Outcome:
    out = Outcome(req, "lost", started=time.monotonic())
    path, body = http_request(req, model, timeout_s)
    kwargs: dict[str, Any] = ({"content": body, "headers": {"content-type": "application/json"}}
                              if isinstance(body, bytes) else {"json": body})

    async def exchange() -> None:
        async with client.stream("POST", base_url + path, **kwargs) as response:
            out.status = str(response.status_code)
            if response.status_code != 200:
                out.kind, out.detail = _http_error(req, response.status_code, await response.aread())
                out.retry_after = "retry-after" in response.headers
            elif req.stream:
                await _read_sse(req, response, out)
            else:
                data = json.loads(await response.aread())
                choice = data["choices"][0]
                out.text = choice["message"]["content"] if req.chat else choice["text"]
                out.kind = "invalid_accepted" if req.invalid else "completed"

    try:
        await asyncio.wait_for(exchange(), deadline_s)
    except TimeoutError:
        out.kind, out.detail = "lost", f"no answer within {deadline_s:g} s"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        out.kind, out.detail = "failed_abrupt", f"{type(exc).__name__}: {exc}"[:300]
    out.ended = time.monotonic()
    return out


async def _read_sse(req: SoakRequest, response: Any, out: Outcome) -> None:
    num_chunks = 0
    text = []
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            out.kind, out.text = ("invalid_accepted" if req.invalid else "completed"), "".join(text)
            return
        chunk = json.loads(data)
        if "error" in chunk:
            out.kind, out.status = "failed_clean", "sse_error"
            out.detail = str(chunk["error"].get("code") or chunk["error"].get("message"))[:300]
            return
        for choice in chunk.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "" if req.chat else choice.get("text") or "")
        num_chunks += 1
        if req.abandon_after and num_chunks >= req.abandon_after:
            out.kind = "abandoned"  # leaving the block closes the connection
            return
        if req.slow:
            await asyncio.sleep(SLOW_READ_S)
    out.kind, out.detail = "failed_abrupt", "the stream ended without [DONE]"


class GrpcClient:
    """Tandem's two generate RPCs on one channel, from the API's message module (no stubs needed)."""

    def __init__(self, address: str, pb: Any, api_key: str | None = None) -> None:
        import grpc

        self.pb = pb
        self.channel = grpc.aio.insecure_channel(address)
        self.generate = self.channel.unary_unary(
            "/tandem.v1.Tandem/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString)
        self.generate_stream = self.channel.unary_stream(
            "/tandem.v1.Tandem/GenerateStream", request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateStreamResponse.FromString)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def close(self) -> None:
        await self.channel.close()


async def send_grpc(client: GrpcClient, req: SoakRequest, *, timeout_s: float, deadline_s: float) -> Outcome:
    import grpc

    out = Outcome(req, "lost", started=time.monotonic())
    message = grpc_request(req, client.pb, timeout_s)
    num_messages = 0
    try:
        if req.stream:
            call = client.generate_stream(message, timeout=deadline_s, metadata=client.metadata)
            async for part in call:
                num_messages += 1
                for choice in part.choices:
                    out.text += choice.text
                    out.token_ids.extend(choice.token_ids)
                if req.abandon_after and num_messages >= req.abandon_after:
                    call.cancel()
                    out.kind = "abandoned"
                    break
                if req.slow:
                    await asyncio.sleep(SLOW_READ_S)
            else:
                out.kind = "invalid_accepted" if req.invalid else "completed"
        else:
            reply = await client.generate(message, timeout=deadline_s, metadata=client.metadata)
            out.text, out.token_ids = reply.choices[0].text, list(reply.choices[0].token_ids)
            out.kind = "invalid_accepted" if req.invalid else "completed"
        out.status = "grpc:OK"
    except grpc.aio.AioRpcError as exc:
        out.status, out.detail = f"grpc:{exc.code().name}", (exc.details() or "")[:300]
        out.kind = _grpc_outcome(req, exc.code(), out.detail, num_messages)
    out.ended = time.monotonic()
    return out


def _grpc_outcome(req: SoakRequest, code: Any, details: str, num_messages: int) -> str:
    import grpc

    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not details.startswith("timeout:"):
        return "lost"  # the client's own deadline: the server said nothing in time
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS):
        return "unexpected_5xx"
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) and num_messages == 0 \
            and _GROUP_FAILED not in details:
        return "rejected"
    if req.invalid:
        return "invalid_answered" if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) \
            else "invalid_accepted"
    if code == grpc.StatusCode.CANCELLED:
        return "failed_abrupt"
    return "failed_clean"
