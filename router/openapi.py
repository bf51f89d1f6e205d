"""The published OpenAPI document (GET /openapi.json), written from the protocol models.

The routes read their bodies themselves (limits.py, then the pydantic models in strict
mode), so FastAPI cannot infer what they take; this module states it: every request
body with its bounds, every response a route can give (OpenAI's error shape for each
4xx / 5xx, `Retry-After` where a client should come back later), and the SSE form of a
streamed answer. A schema-driven fuzzer (tests/serve/test_fuzz_http.py) holds the
server to it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tandem.router.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
)
from tandem.router.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "a bad request: invalid JSON, a wrong type, a value out of range, a prompt too long for the context",
    "401": "a missing or wrong API key",
    "404": "the model is not served here",
    "413": "the body is larger than the server's limit",
    "408": "the request's own `timeout` passed before it finished (its KV is freed)",
    "415": "the body is not JSON",
    "429": "the replica groups are full: retry after Retry-After seconds",
    "500": "an internal error (its id is in the server log)",
    "503": "no replica group can serve now: retry after Retry-After seconds",
}
# /tokenize and /detokenize involve no group: none of the generation routes' waits or deadlines.
_TOKENIZATION_ERRORS = ("400", "401", "404", "413", "415", "429", "500")
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                                "schema": {"type": "integer", "minimum": 0}}}


def openapi_document(title: str = "tandem", version: str = "0.1.0") -> dict[str, Any]:
    models: list[tuple[type[BaseModel], str]] = [
        (CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
        (CompletionResponse, "serialization"), (ChatCompletionResponse, "serialization"),
        (ChatCompletionChunk, "serialization"), (ModelList, "serialization"), (ErrorResponse, "serialization"),
        (Health, "serialization"), (TokenizeCompletionRequest, "validation"), (TokenizeChatRequest, "validation"),
        (TokenizeResponse, "serialization"), (DetokenizeRequest, "validation"), (DetokenizeResponse, "serialization")]
    _, top = models_json_schema(models, ref_template=_REF)
    paths = {
        "/v1/completions": {"post": _generation("Create a completion", "CompletionRequest", "CompletionResponse",
                                                "CompletionResponse")},
        "/v1/chat/completions": {"post": _generation("Create a chat completion", "ChatCompletionRequest",
                                                     "ChatCompletionResponse", "ChatCompletionChunk")},
        "/tokenize": {"post": _tokenization(
            "A prompt's tokens, or a chat's as its template renders it (vLLM's)", "tokenize",
            {"anyOf": [{"$ref": _REF.format(model="TokenizeCompletionRequest")},
                       {"$ref": _REF.format(model="TokenizeChatRequest")}]}, "TokenizeResponse")},
        "/detokenize": {"post": _tokenization("Tokens' text (vLLM's)", "detokenize",
                                              {"$ref": _REF.format(model="DetokenizeRequest")}, "DetokenizeResponse")},
        "/v1/models": {"get": {"summary": "The served model", "operationId": "listModels",
                               "responses": {"200": _json("the served model", "ModelList"),
                                             "401": _json(_ERRORS["401"], "ErrorResponse")}}},
        "/health": {"get": {"summary": "Readiness: 200 while a replica group serves", "operationId": "health",
                            "responses": {"200": _json("a replica group serves (status ok, or degraded while "
                                                       "another is down)", "Health"),
                                          "503": _json("no replica group can serve", "Health")}}},
        "/live": {"get": {"summary": "Liveness: 200 while this ingress replica answers", "operationId": "live",
                          "responses": {"200": {"description": "alive",
                                                "content": {"application/json": {"schema": {
                                                    "type": "object", "required": ["status"],
                                                    "properties": {"status": {"const": "alive"}}}}}}}}},
    }
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": top["$defs"],
                           "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}}}}


def _generation(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    ok = _json("the whole answer, or with `stream: true` its server-sent events", response)
    ok["content"]["text/event-stream"] = {"schema": _sse_event(chunk)}
    responses: dict[str, Any] = {"200": ok}
    for status, description in _ERRORS.items():
        responses[status] = _json(description, "ErrorResponse")
        if status in ("429", "503"):
            responses[status]["headers"] = _RETRY_AFTER
    return {"summary": summary, "operationId": request[0].lower() + request[1:].removesuffix("Request"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(
                model=request)}}}},
            "responses": responses}


def _tokenization(summary: str, operation_id: str, request_schema: dict[str, Any], response: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": _json("the answer", response)}
    for status in _TOKENIZATION_ERRORS:
        responses[status] = _json(_ERRORS[status], "ErrorResponse")
        if status == "429":  # the body budget (body_budget.py)
            responses[status]["headers"] = _RETRY_AFTER
    return {"summary": summary, "operationId": operation_id,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}},
            "responses": responses}


def _sse_event(chunk_model: str) -> dict[str, Any]:
    """One server-sent event: `data` is a chunk (an error object if the stream fails) or [DONE]."""
    chunk = {"anyOf": [{"$ref": _REF.format(model=chunk_model)}, {"$ref": _REF.format(model="ErrorResponse")}]}
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": chunk}}
    return {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}


def _json(description: str, model: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model)}}}}
