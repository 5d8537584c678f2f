"""The OpenAPI schema describes what the gateway really answers: every error is the OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` (see `gateway/api/errors.py`), Anthropic's
`{"type": "error", "error": {"type", "message"}}` on the Anthropic routes (tagged `anthropic`), validation errors are
400 (not FastAPI's 422), the generation routes may stream `text/event-stream`, and an integer's bounds are the
integers the validation takes. Fuzzing checks answers against it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.api.bounds import INT64_MAX

ERROR_BODY = "ErrorBody"
_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
        }
    },
}

ANTHROPIC_ERROR_BODY = "AnthropicErrorBody"
ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}

ERRORS = {
    "400": "Invalid request: malformed, out of range or over a limit; `param` names the field.",
    "401": "Missing credentials (admin token, metrics token or API key, where the gateway requires one).",
    "403": "Wrong credentials.",
    "404": "Unknown model, session or replica.",
    "409": "Conflict, e.g. a weight version that is not newer than the current one.",
    "413": "Request body over server.max_body_bytes.",
    "429": "Backpressure (the trainer lags), or a per-key limit (sessions in flight, open sessions); see Retry-After.",
    "502": "An engine replica answered something its protocol does not allow.",
    "503": "No replica could serve within generation.max_wait_s, or Redis is unreachable past its retry budget.",
    "504": "An engine replica timed out.",
}
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}
"""One server-sent event of a stream (fuzzing checks each event against it): its data, and Anthropic's its name."""
STREAMING = {"/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/v1/responses"}


def _document(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    responses.pop("422", None)
    body = ANTHROPIC_ERROR_BODY if "anthropic" in operation.get("tags", ()) else ERROR_BODY
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}}
    for status, description in ERRORS.items():
        # A route may describe an error status its own way (`/admin/weights`' 502); the body is the same.
        responses.setdefault(status, {"description": description}).update(error)
    ok = responses.get("200")
    if path.removeprefix("/sessions/{session_id}") in STREAMING and ok is not None:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT_SCHEMA}


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# FastAPI's OpenAPI model types every bound as a float, and a float cannot hold 2**63 - 1 (the largest seed): it
# rounds up to 2.0**63, a value the validation refuses. Every other bound of ours is exact as a float.
_ROUNDED = {float(INT64_MAX): INT64_MAX}


def _integer_bounds(node: Any) -> None:
    """Give every integer schema under `node` its bounds back as integers."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key in _BOUNDS:
            if isinstance(value := node.get(key), float):
                node[key] = _ROUNDED.get(value, int(value))
    for value in node.values():
        _integer_bounds(value)


def install_openapi(app: FastAPI) -> None:
    """Replace the app's schema generator with one that documents the error responses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas[ERROR_BODY] = ERROR_SCHEMA
            schemas[ANTHROPIC_ERROR_BODY] = ANTHROPIC_ERROR_SCHEMA
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            _integer_bounds(schema)
            for path, item in schema.get("paths", {}).items():
                for operation in item.values():
                    _document(path, operation)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
