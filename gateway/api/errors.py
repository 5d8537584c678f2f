"""Exceptions become error responses here, and nowhere else.

Body: OpenAI's `{"error": {"message", "type", "param", "code"}}`, plus the exception's `details` where it has any (a
failed weight update's per-replica errors). Status comes from the exception class (see `gateway/errors.py`);
request-validation errors are 400 and name the offending field.

A route of `AnthropicErrorsRoute` (the Anthropic Messages routes) answers in Anthropic's shape instead, with the same
status: `{"type": "error", "error": {"type", "message"}}` (`anthropic_error`). The route is in the request's scope
from routing on, so its body's validation, its auth dependencies and its endpoint all answer in its shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.asgi import ClientDisconnected, disconnected_response
from gateway.errors import GatewayError

logger = logging.getLogger(__name__)

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class AnthropicErrorsRoute(APIRoute):
    """A FastAPI route whose errors are answered in Anthropic's shape (this module's docstring)."""


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: its type by status (4xx it has no type for are `invalid_request_error`, 5xx
    `api_error`)."""
    error_type = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _anthropic_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    body = orjson.dumps(anthropic_error(status, message))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _anthropic(request: Request) -> bool:
    return isinstance(request.scope.get("route"), AnthropicErrorsRoute)


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    details: Mapping[str, object] | None = None,
) -> Response:
    error: dict[str, object] = {"message": message, "type": error_type, "param": param, "code": code}
    if details:
        error |= {key: value for key, value in details.items() if key not in error}  # the OpenAI four come first
    body = {"error": error}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


async def on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
    param = _field(tuple(first.get("loc", ())))
    details = "; ".join(f"{_field(tuple(e.get('loc', ())))}: {e.get('msg')}" for e in errors[:5])
    if _anthropic(request):
        return _anthropic_response(400, details)
    return error_response(400, details, "invalid_request_error", param=param)


async def on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    if exc.status_code >= 500:
        logger.warning("%s: %s", type(exc).__name__, exc)  # str(exc): the whole cause, which the answer may leave out
    headers = None
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    if _anthropic(request):
        return _anthropic_response(exc.status_code, exc.message, headers)
    return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code, headers, exc.details)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if _anthropic(request):
        return _anthropic_response(exc.status_code, str(exc.detail), exc.headers)
    error_type = _HTTP_TYPES.get(exc.status_code, "api_error")
    return error_response(exc.status_code, str(exc.detail), error_type, headers=exc.headers)


def stream_error(exc: Exception) -> GatewayError:
    """What a stream that already started tells its client in its error event: a `GatewayError` as it is, anything
    else (a bug) logged with its traceback and told as a 500 without its details."""
    if isinstance(exc, GatewayError):
        return exc
    logger.error("error after the stream started", exc_info=exc)
    return GatewayError(f"internal error: {type(exc).__name__}")


async def on_unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error")
    message = f"internal error: {type(exc).__name__}"
    if _anthropic(request):
        return _anthropic_response(500, message)
    return error_response(500, message, "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ClientDisconnected, disconnected_response)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
