"""OpenAIIngress: the FastAPI ingress deployment (HTTP; gRPC through the GrpcMethods mixin).

    GET  /v1/models             the served model
    POST /v1/completions        prompts (strings, token ids, lists of either)
    POST /v1/chat/completions   messages through the model's chat template
    POST /tokenize              a prompt's or a chat's tokens; POST /detokenize: tokens' text
                                (vLLM's; tokenization.py)
    GET  /health                readiness: 200 while a replica group serves, 503 when none can
    GET  /live                  liveness: 200 while this ingress replica answers
    GET  /admin/kv              KV blocks held now, per group and in the allocator (kv_report.py)

Every error has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
400 for a bad request (invalid JSON, wrong type, out of range, too long for the
context), 401 for a missing or wrong API key, 404 for an unknown model, 413 / 415 for a
body too large or not JSON (limits.py), 429 when the groups are full and 503 when none can
serve (both with Retry-After; admission.py sheds before any tokenizing), and a bare 500
with an id for anything unexpected (errors.py). The request is tokenized and validated
here, so a bad one never reaches a group: that includes a structured-output spec, compiled
here first (grammar_check.py). OpenAI fields tandem does not do are refused by name
(request_fields.py); fields no API defines are ignored with one log line per request. The
`x-tandem-groups` response header names the
replica group(s) serving the response.
A request whose own `timeout` passes is aborted (its KV freed) and answered 408; one
whose group fails mid-way ends with a 503 (an SSE error event once streaming began).
"""

# NOTE: @serve.ingress freezes the FastAPI app (a cloudpickle round trip) when the decorator
# runs, so the route methods keep only the module globals that exist at that point and that
# their code names. Hence every helper they use is defined above the class, and there is no
# `from __future__ import annotations`: FastAPI could not resolve the string `"Request"`
# against those globals and would ask for a `request` query parameter (422).

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from ray import serve

from tandem.router.admission import Admission, AdmissionLimits, NoGroupUp, Overloaded, ReleasingStream, Ticket
from tandem.router.api_key import key_matches
from tandem.router.body_budget import BodyBudget
from tandem.router.chat import ChatServing
from tandem.router.completions import CompletionServing
from tandem.router.engine_client import EngineClient, RequestTimeout, ServiceUnavailable
from tandem.router.errors import install_error_handlers, overloaded, unavailable
from tandem.router.kv_report import kv_holdings
from tandem.router.limits import RequestLimits, read_json_object
from tandem.router.openapi import openapi_document
from tandem.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Health,
    ModelCard,
    ModelList,
    OpenAIError,
)
from tandem.router.request_fields import log_names, refuse_unsupported, unknown_fields
from tandem.router.sse_response import LastChunk, SSEResponse
from tandem.router.streams import DONE, sse
from tandem.router.tokenization import DetokenizeRequest, TokenizationServing, tokenize_request_model
from tandem.router.tracing import TracingMiddleware
from tandem.workers.serving import tracer
from tandem.workers.young_generation import widen_young_generation

logger = logging.getLogger(__name__)

try:  # gRPC on the same deployment, when its module is there (router/grpc_service.py)
    from tandem.router.grpc_service import GrpcMethods
except ImportError as exc:
    if getattr(exc, "name", None) != "tandem.router.grpc_service":
        logger.warning("gRPC methods unavailable: %s", exc)
    GrpcMethods = object

GROUP_HEADER = "x-tandem-groups"  # the replica groups serving a response (one per prompt)

@asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    yield
    try:
        server = serve.get_replica_context().servable_object
    except Exception:  # noqa: BLE001 - no replica (a bare app): nothing of ours to stop
        return
    client = getattr(server, "client", None)
    if client is not None:
        await client.close()  # its channels' pumps end on this loop, not at its teardown


app = FastAPI(title="tandem", docs_url=None, redoc_url=None, lifespan=_lifespan)
install_error_handlers(app)
app.openapi = openapi_document  # the routes parse their own bodies: the document states them
app.add_middleware(TracingMiddleware)  # a span per request when tracing is on (router/tracing.py)

RETRY_AFTER_S = 1  # when a group refuses for overload (Serve's backstop queue is full)


def _unavailable(exc: ServiceUnavailable) -> OpenAIError:
    return unavailable(str(exc), getattr(exc, "retry_after_s", RETRY_AFTER_S))


def _timed_out(exc: RequestTimeout) -> OpenAIError:
    return OpenAIError(408, f"timeout: {exc}", param="timeout", code="request_timeout")


async def _guard_stream(chunks):
    """Errors after the first byte cannot change the status: send them as an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except ValueError as exc:
        yield LastChunk(sse(OpenAIError.bad_request(exc).body) + DONE)
    except ServiceUnavailable as exc:
        yield LastChunk(sse(_unavailable(exc).body) + DONE)
    except RequestTimeout as exc:
        yield LastChunk(sse(_timed_out(exc).body) + DONE)


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress(GrpcMethods):
    def __init__(self, group, config: dict[str, Any]) -> None:
        from tandem.workers.model.demo_model import demo_model_path
        from tandem.workers.model.hf_config import HFModelConfig
        from tandem.workers.model.source import tokenizer_dir
        from tandem.workers.text.tokenizer import load_tokenizer

        model_dir = config.get("model") or demo_model_path()
        hf_config = HFModelConfig.from_dir(model_dir, config.get("revision"))
        # A replica that only tokenizes never loads torch (~230 MB): a pick not yet remembered
        # on this node is made in a child process.
        tokenizer = load_tokenizer(tokenizer_dir(model_dir, config.get("tokenizer"), config.get("revision")),
                                   pick_in_child=True)
        widen_young_generation()  # each stream's deltas die before a collection walks them
        self.client = EngineClient(
            group, tokenizer=tokenizer, model_name=config["served_model_name"],
            max_model_len=config.get("max_model_len") or hf_config.max_position_embeddings,
            vocab_size=hf_config.vocab_size, channels=config.get("stream_channels", True),
            max_chunks_per_s=config.get("max_chunks_per_s", 0.0), request_timeout_s=config.get("request_timeout_s"),
            eos_token_ids=hf_config.eos_token_ids, max_sent_on_channel=config.get("max_sent_on_channel", 0),
            export_metrics=config.get("metrics", True))
        self.api_key = config.get("api_key_sha256")  # the key's digest (router/api_key.py)
        if self.api_key is None:
            logger.warning("tandem: no API key: whoever reaches this server's HTTP and gRPC ports may use it")
        self.limits = RequestLimits(**config.get("limits", {}))
        self.body_budget = BodyBudget(self.limits.body_bytes_in_flight)
        admission = config.get("admission")
        self.admission = (Admission(AdmissionLimits.from_dict(admission), self.client.groups_up)
                          if admission else None)
        self.created = int(time.time())
        self.completions = CompletionServing(self.client)
        self.chat = ChatServing(self.client, tool_call_parser=config.get("tool_call_parser"),
                                enable_auto_tool_choice=config.get("enable_auto_tool_choice", False))
        self.tokenization = TokenizationServing(self.client)

    def __del__(self) -> None:
        tracer.flush_on_stop(timeout_s=5.0)  # a graceful stop: the last spans still batched go out

    # ---- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """Readiness, for a load balancer: 200 while at least one replica group serves
        ("ok", or "degraded" while another is down or restarting), 503 when none can."""
        report = await self.client.health()
        status = "ok" if report["all_healthy"] else "degraded" if report["ready"] else "unavailable"
        return JSONResponse(Health(status=status, groups=report["groups"]).model_dump(),
                            status_code=200 if report["ready"] else 503)

    @app.get("/live")
    async def live(self) -> Response:
        """Liveness: this ingress replica's event loop answers (whatever the groups do)."""
        return JSONResponse({"status": "alive"})

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        card = ModelCard(id=self.client.model_name, created=self.created, max_model_len=self.client.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/admin/kv")
    async def admin_kv(self, request: Request) -> JSONResponse:
        # What every group holds, and their processes' ids: for operators only, so never
        # without a key (a server without one has no operators to tell apart).
        if self.api_key is None:
            raise OpenAIError(404, "GET /admin/kv is off on a server without an API key (set TANDEM_API_KEY or "
                              "--api-key-file)", code="not_found")
        self._authorize(request)
        app_name = serve.get_replica_context().app_name
        # Blocking Ray calls, so on a thread.
        return JSONResponse(await asyncio.to_thread(kv_holdings, app_name))

    @app.post("/v1/completions")
    async def create_completion(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        return await self._respond(self.completions.create, req,
                                   self._sequences(req.n, req.num_prompts, req.logprobs, "logprobs"), req.n)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        return await self._respond(self.chat.create, req, self._sequences(req.n, 1, req.top_logprobs, "top_logprobs"),
                                   req.n)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        # No group is involved: no admission ticket, the key and the body bounds only.
        req = await self._parse(request, tokenize_request_model)
        try:
            return JSONResponse((await self.tokenization.tokenize(req)).model_dump())
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        req = await self._parse(request, DetokenizeRequest)
        try:
            return JSONResponse((await self.tokenization.detokenize(req)).model_dump())
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    # ---- helpers -------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token, self.api_key):
            raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")

    async def _parse(self, request: Request, model: type[BaseModel] | Callable[[dict], type[BaseModel]]) -> Any:
        """The body as `model` (or as the model `model(body)` picks): fields tandem does not do
        refused by name, fields no API defines logged once and ignored."""
        self._authorize(request)
        body = await read_json_object(request, self.limits, self.body_budget)
        if not isinstance(model, type):
            model = model(body)
        refuse_unsupported(body, model)
        unknown = unknown_fields(body, model)
        if unknown:
            logger.warning("%s: ignored fields that no API defines: %s", request.url.path, log_names(unknown))
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise OpenAIError.from_validation(exc) from None
        if req.model is not None and req.model != self.client.model_name:
            raise OpenAIError(404, f"the model '{req.model}' does not exist (this server has "
                              f"'{self.client.model_name}')", param="model", code="model_not_found")
        return req

    def _sequences(self, n: int, num_prompts: int, logprobs: int | None, logprobs_field: str) -> int:
        """What admission charges the request (its sequences), or 400 past this server's bounds."""
        try:
            return self.limits.sequences(n, num_prompts, logprobs, logprobs_field)
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None

    async def _admit(self, cost: int, one_group: int) -> Ticket | None:
        """Admission before any tokenizing: 429 / 503 at once when the groups cannot take it."""
        if self.admission is None:
            return None
        try:
            return await self.admission.admit(cost, one_group)
        except ValueError as exc:  # more than could ever be admitted
            raise OpenAIError.bad_request(exc) from None
        except Overloaded as exc:
            raise overloaded(exc.message, exc.retry_after_s) from None
        except NoGroupUp as exc:
            raise _unavailable(exc) from None

    async def _respond(self, create, req, cost: int, one_group: int) -> Response:
        source = req.structured_source
        if source is not None:  # compiled before admission and any group: a bad spec is a 400 now
            try:
                await self.client.grammar.check(source.spec, source.field)
            except ValueError as exc:
                raise OpenAIError.bad_request(exc) from None
        ticket = await self._admit(cost, one_group)
        streaming = False
        try:
            reply = await create(req)
            streaming = not isinstance(reply.body, BaseModel)
        except ValueError as exc:
            raise OpenAIError.bad_request(exc) from None
        except ServiceUnavailable as exc:
            raise _unavailable(exc) from None
        except RequestTimeout as exc:
            raise _timed_out(exc) from None
        finally:
            if ticket is not None and not streaming:  # a whole answer is done; a refused one never ran
                ticket.release()
        headers = {GROUP_HEADER: ",".join(reply.group_ids)}
        if isinstance(reply.body, BaseModel):
            return JSONResponse(reply.body.model_dump(), headers=headers)
        body = _guard_stream(reply.body)
        if ticket is not None:
            ticket.assign(reply.group_ids)
            body = ReleasingStream(body, ticket)
        return SSEResponse(body, headers=headers)
