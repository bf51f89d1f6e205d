"""Helpers of the bench tests: running `tandem bench ...` in this process; a fake OpenAI
streaming server to load."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tandem.bench.bench_models import BenchShape
from tandem.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The code path of --bench-model at the size of the tests' tiny models.
TINY_SHAPE = BenchShape("llama-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                        max_position_embeddings=512, tie_word_embeddings=True)


def bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """`tandem bench ARGV --output-json ...` through the CLI's entry point; the figures it wrote."""
    out = tmp_path / "figures.json"
    assert main(["bench", *argv, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


FIRST_TOKEN_S = 0.08  # the fake server's time to first token
TOKEN_GAP_S = 0.02  # and between tokens


class FakeOpenAIServer:
    """/v1/completions streaming one chunk per token at fixed delays, then usage (or, not
    streaming, the whole answer after the same delays); /v1/models."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.fail_prompt_len: int | None = None  # prompts of this length get a 400
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if len(body["prompt"]) == self.fail_prompt_len:
            return web.json_response({"error": {"message": "prompt: too long", "type": "invalid_request_error"}},
                                     status=400)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "total_tokens": len(body["prompt"]) + body["max_tokens"]}
        if not body["stream"]:
            await asyncio.sleep(FIRST_TOKEN_S + (body["max_tokens"] - 1) * TOKEN_GAP_S)
            text = "".join(f"t{i}" for i in range(body["max_tokens"]))
            return web.json_response({"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                      "usage": usage}, headers={"x-tandem-groups": "g1"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(FIRST_TOKEN_S if i == 0 else TOKEN_GAP_S)
            last = i == body["max_tokens"] - 1
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": "length" if last else None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return response


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeOpenAIServer, str]]:
    server = FakeOpenAIServer()
    with server as url:
        yield server, url
