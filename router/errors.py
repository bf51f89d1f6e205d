"""Every HTTP error in OpenAI's shape, and nothing of the server's insides in any of them.

`install_error_handlers(app)` makes the ingress answer

    OpenAIError            its status, body and headers (Retry-After on 429 / 503)
    unknown path / method  404 / 405 (with Allow) in the same shape, not Starlette's {"detail"}
    FastAPI's own 422      400, as the rest of the body checks
    anything else          500 "internal error (id ...)": the traceback goes to the server log
                           under that id, never to the client (no stack, no file path)

`overloaded` and `unavailable` are the two "not now" answers: 429 when the groups that are
up are full, 503 when no group can serve; both say when to come back.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.router.protocol import OpenAIError

logger = logging.getLogger(__name__)

_HTTP_MESSAGES = {404: "no such endpoint: see /v1/models, /v1/completions, /v1/chat/completions, /tokenize, "
                       "/detokenize, /health",
                  405: "method not allowed on this endpoint"}


def overloaded(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(429, f"overloaded: {message}; retry after {retry_after_s} s", code="overloaded",
                       type="rate_limit_error", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(503, f"service unavailable: {message}", code="service_unavailable",
                       headers={"Retry-After": str(retry_after_s)})


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=error.headers)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = _HTTP_MESSAGES.get(exc.status_code, f"HTTP {exc.status_code}")
    error = OpenAIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                        type="invalid_request_error", headers=dict(exc.headers or {}))
    return error_response(error)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(OpenAIError(400, "the request does not match the endpoint's schema", code="invalid_type"))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    error_id = uuid.uuid4().hex[:16]
    logger.error("internal error %s in %s %s", error_id, request.method, request.url.path, exc_info=exc)
    return error_response(OpenAIError(500, f"internal error (id {error_id})", code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
