"""OpenAIIngress: the FastAPI ingress deployment (HTTP; gRPC through the GrpcMethods mixin).

    GET  /v1/models             the served model
    POST /v1/completions        prompts (strings, token ids, lists of either)
    POST /v1/chat/completions   messages through the model's chat template
    GET  /health                200 only when every replica group can serve

Every error has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
400 for a bad request (invalid JSON, wrong type, out of range, too long for the
context), 401 for a missing or wrong API key, 404 for an unknown model, 503 when the
groups are overloaded or none can serve. The request is tokenized and validated here,
so a bad one never reaches a group. The `x-tandem-groups` response header names the
replica group(s) serving the response.
"""

# NOTE: @serve.ingress freezes the FastAPI app (a cloudpickle round trip) when the decorator
# runs, so the route methods keep only the module globals that exist at that point and that
# their code names. Hence every helper they use is defined above the class, and there is no
# `from __future__ import annotations`: FastAPI could not resolve the string `"Request"`
# against those globals and would ask for a `request` query parameter (422).

import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve

from tandem.router.chat import ChatServing
from tandem.router.completions import CompletionServing
from tandem.router.engine_client import EngineClient, ServiceUnavailable
from tandem.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
)
from tandem.router.streams import DONE, sse
from tandem.router.tracing import TracingMiddleware

logger = logging.getLogger(__name__)

try:  # gRPC on the same deployment, when its module is there (router/grpc_service.py)
    from tandem.router.grpc_service import GrpcMethods
except ImportError as exc:
    if getattr(exc, "name", None) != "tandem.router.grpc_service":
        logger.warning("gRPC methods unavailable: %s", exc)
    GrpcMethods = object

GROUP_HEADER = "x-tandem-groups"  # the replica groups serving a response (one per prompt)

app = FastAPI(title="tandem", docs_url=None, redoc_url=None)
app.add_middleware(TracingMiddleware)  # a span per request when tracing is on (router/tracing.py)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body.model_dump(), status_code=exc.status)


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    error = OpenAIError(500, f"internal error: {type(exc).__name__}")
    return JSONResponse(error.body.model_dump(), status_code=500)


def _unavailable(exc: ServiceUnavailable) -> OpenAIError:
    return OpenAIError(503, f"service unavailable: {exc}", code="service_unavailable")


async def _guard_stream(chunks):
    """Errors after the first byte cannot change the status: send them as an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except ValueError as exc:
        yield sse(OpenAIError.bad_request(exc).body)
        yield DONE
    except ServiceUnavailable as exc:
        yield sse(_unavailable(exc).body)
        yield DONE


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress(GrpcMethods):
    def __init__(self, group, config: dict[str, Any]) -> None:
        from tandem.workers.model.demo_model import demo_model_path
        from tandem.workers.model.hf_config import HFModelConfig
        from tandem.workers.text.tokenizer import load_tokenizer

        model_dir = config.get("model") or demo_model_path()
        hf_config = HFModelConfig.from_dir(model_dir)
        self.client = EngineClient(
            group, tokenizer=load_tokenizer(model_dir), model_name=config["served_model_name"],
            max_model_len=config.get("max_model_len") or hf_config.max_position_embeddings,
            vocab_size=hf_config.vocab_size)
        self.api_key = config.get("api_key")
        self.created = int(time.time())
        self.completions = CompletionServing(self.client)
        self.chat = ChatServing(self.client)

    # ---- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        healthy = await self.client.health()
        return Response(status_code=200 if healthy else 503)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        card = ModelCard(id=self.client.model_name, created=self.created, max_model_len=self.client.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def create_completion(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        return await self._respond(self.completions.create(req))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        return await self._respond(self.chat.create(req))

    # ---- helpers -------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        self._authorize(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"invalid JSON body: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise OpenAIError.from_validation(exc) from None
        if req.model is not None and req.model != self.client.model_name:
            raise OpenAIError(404, f"the model '{req.model}' does not exist (this server has "
                              f"'{self.client.model_name}')", param="model", code="model_not_found")
        return req

    async def _respond(self, pending) -> Response:
        try:
            reply = await pending
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None
        except ServiceUnavailable as exc:
            raise _unavailable(exc) from None
        headers = {GROUP_HEADER: ",".join(reply.group_ids)}
        if isinstance(reply.body, BaseModel):
            return JSONResponse(reply.body.model_dump(), headers=headers)
        return StreamingResponse(_guard_stream(reply.body), media_type="text/event-stream", headers=headers)
