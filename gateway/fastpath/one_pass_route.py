"""`OnePassRoute`: FastAPI's `APIRoute` with a shorter request path for routes of one plain shape.

FastAPI's request handler is generic: on a short `/generate` it reads the body, parses it with the standard
library's `json`, checks the content type by building an `email.message.Message`, validates the resulting dict with
a `TypeAdapter`, and runs `solve_dependencies` over the route's dependency tree; together a visible share of the
gateway's CPU on a short request (docs/benchmarks.md). For a route whose endpoint takes exactly one pydantic model
as its body, the raw `Request`, and dependencies that are plain `async def dependency(request)` (the gateway's
`require_agent` and `services`), the lean handler does the same work directly: read the body, apply FastAPI's
content-type rule, validate the JSON in one pass in pydantic-core (`model_validate_json`), await the dependencies in
FastAPI's order, call the endpoint.

It takes only the path where nothing goes wrong. Anything else goes to FastAPI's own handler for the same request
(Starlette keeps the body it read), so every refusal is FastAPI's answer, byte for byte: an empty body, a content
type FastAPI would not parse as JSON, a body that does not validate (pydantic is stricter than the standard
library on a UTF-8 BOM, lone surrogates and nesting deeper than 200: FastAPI parses those again and decides), a
body that could not be read, dependency overrides, and requests FastAPI's OpenTelemetry support traces. A route
of any other shape keeps FastAPI's handler, so the class is safe on any router; the route object itself is
FastAPI's (same dependant, same OpenAPI schema). `tests/gateway/fastpath/test_one_pass_route.py` compares both
handlers answer by answer, and checks that pydantic's JSON parser accepts nothing the standard library refuses.

What it pays (`benchmarks.ab . . --together --set-b RG_FASTPATH__ONE_PASS_ROUTES=false`, 4 rounds, 2-core host,
83d6584): with it off the gateway spends 1.22× the CPU per `multiturn` chat request and 1.08× per streamed `rl` token.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import params
from fastapi.datastructures import DefaultPlaceholder
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_typed_return_annotation
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

__all__ = ["OnePassCall", "OnePassRoute", "is_json_content_type", "one_pass_call"]

# Names of recent FastAPI releases, two of them private. Where one is missing (an older or a reworked FastAPI), the
# route class falls back to FastAPI's own handler instead of failing the import: the gateway then only runs slower.
try:
    from fastapi.routing import _effective_route_context_var  # type: ignore[attr-defined,unused-ignore]
    from fastapi.telemetry import get_telemetry_data  # type: ignore[import-not-found,unused-ignore]

    _FASTAPI_KNOWN = True
except ImportError:  # pragma: no cover - depends on the installed FastAPI
    _FASTAPI_KNOWN = False

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class OnePassRoute(APIRoute):
    """An `APIRoute` whose handler skips FastAPI's generic machinery where the route's shape allows (see above)."""

    def get_route_handler(self) -> Handler:
        stock = super().get_route_handler()
        call = one_pass_call(self._effective())
        return stock if call is None else _lean_handler(stock, call)

    def _effective(self) -> Any:
        """The route as served: FastAPI builds an included route's handler with the inclusion's settings (its
        dependencies, its app for dependency overrides) in a context variable, read here as
        `APIRoute.get_route_handler` reads it (a private name of FastAPI's: a rename fails the import)."""
        if not _FASTAPI_KNOWN:
            return self
        context = _effective_route_context_var.get()
        if context is not None and context.original_route is self:
            return context
        return self


def one_pass_call(route: Any) -> OnePassCall | None:
    """The lean path of `route` (an `APIRoute` or FastAPI's effective context of an included one), or None where
    FastAPI's own handler must serve it: a shape the lean path does not cover, a response model, or a FastAPI
    without the names it relies on."""
    if not _FASTAPI_KNOWN:
        return None
    shape = _shape(route.dependant)
    if shape is None or route.response_field is not None:
        return None
    strict = getattr(route, "strict_content_type", True)
    if isinstance(strict, DefaultPlaceholder):
        strict = strict.value
    return OnePassCall(shape, json_without_content_type=not strict, overrides=route.dependency_overrides_provider)


@dataclass(frozen=True)
class _Shape:
    """What the lean handler needs of a route: the endpoint and its parameters' names, the body model, the
    dependencies in FastAPI's order as (the endpoint parameter it fills or None, the `async def`, the name of its
    `Request` parameter)."""

    endpoint: Callable[..., Awaitable[Response]]
    request_param: str
    body_param: str
    model: type[BaseModel]
    dependencies: tuple[tuple[str | None, Callable[..., Awaitable[Any]], str], ...]


class OnePassCall:
    """The lean path of one route, in the three steps that `OnePassRoute`'s handler and the gateway's fast lane
    (`gateway.fastpath.hot_routes`) both take: whether FastAPI must serve the request anyway (`bypassed`), the body
    parsed and validated or None (`parse`), and the dependencies and endpoint run on the parsed body (`respond`).
    """

    def __init__(self, shape: _Shape, *, json_without_content_type: bool, overrides: Any) -> None:
        self._shape = shape
        self._json_without_content_type = json_without_content_type
        self._overrides = overrides

    def bypassed(self) -> bool:
        """FastAPI serves the request itself: dependency overrides are set, or its OpenTelemetry support traces."""
        return self.overridden() or get_telemetry_data() is not None

    def overridden(self) -> bool:
        """Dependency overrides are set (FastAPI must serve the request, to apply them)."""
        overrides = self._overrides
        return overrides is not None and bool(overrides.dependency_overrides)

    def parse(self, body: bytes, content_type: str | None) -> BaseModel | None:
        """The body validated into the route's model, or None where FastAPI must decide: an empty body, a content
        type FastAPI would not parse as JSON, a body that does not validate (pydantic is stricter than the standard
        library on a UTF-8 BOM, lone surrogates and nesting deeper than 200: FastAPI parses those again and decides;
        its validation error comes after the dependencies ran, so an auth failure comes first)."""
        if not body or not (is_json_content_type(content_type) if content_type else self._json_without_content_type):
            return None
        try:
            return self._shape.model.model_validate_json(body)
        except Exception:
            return None

    async def respond(self, request: Request, value: BaseModel) -> Response:
        """Await the dependencies in FastAPI's order, then the endpoint."""
        shape = self._shape
        values: dict[str, Any] = {shape.body_param: value, shape.request_param: request}
        for name, call, call_request_param in shape.dependencies:
            solved = await call(**{call_request_param: request})
            if name is not None:
                values[name] = solved
        return await shape.endpoint(**values)


def _lean_handler(stock: Handler, call: OnePassCall) -> Handler:
    async def handler(request: Request) -> Response:
        if call.bypassed():
            return await stock(request)
        try:
            body = await request.body()
        except Exception as exc:
            # FastAPI maps a failed read to its answer (400; 413 for a body limit of its own): let it, on a
            # request whose read fails the same way.
            return await stock(Request(request.scope, _failing_receive(exc)))
        value = call.parse(body, request.headers.get("content-type"))
        if value is None:
            return await stock(request)
        return await call.respond(request, value)

    return handler


@functools.lru_cache(maxsize=64)
def is_json_content_type(content_type: str) -> bool:
    """FastAPI's rule for parsing a body as JSON: media type `application/json` or `application/*+json`, any
    parameters, any case. FastAPI gets the media type from an `email.message.Message` (`get_content_type`); this
    is that parse, without building a message per request (and remembered: clients send the same few values)."""
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type.count("/") != 1:
        return False  # email's fallback for an invalid media type is text/plain
    main, sub = media_type.split("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _failing_receive(exc: Exception) -> Receive:
    async def receive() -> Message:
        raise exc

    return receive


def _shape(dependant: Dependant) -> _Shape | None:
    """The route's shape if the lean handler can serve it: an `async def` endpoint returning a `Response` that
    takes the `Request`, one pydantic model as the whole body, and dependencies that are each an `async def` of
    the request alone (no sub-dependencies, no concurrency limit, none repeated: FastAPI runs a repeated one
    once); no path, query, header or cookie parameters, no background tasks."""
    call = dependant.call
    if call is None or not inspect.iscoroutinefunction(call) or _other_params(dependant):
        return None
    if dependant.request_param_name is None or len(dependant.body_params) != 1:
        return None
    returns = get_typed_return_annotation(call)
    if not (inspect.isclass(returns) and issubclass(returns, Response)):
        return None
    body = dependant.body_params[0]
    info = body.field_info
    if not isinstance(info, params.Body) or isinstance(info, params.Form) or info.embed or info.metadata:
        return None  # embedded, a form, or constrained beyond the model: FastAPI validates more than the model
    model = info.annotation
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        return None
    dependencies = []
    for dependency in dependant.dependencies:
        dependency_call = dependency.call
        request_param = dependency.request_param_name
        if dependency_call is None or not inspect.iscoroutinefunction(dependency_call) or request_param is None:
            return None
        if (
            dependency.dependencies
            or dependency.body_params
            or getattr(dependency, "concurrency", None)
            or _other_params(dependency)
        ):
            return None
        dependencies.append((dependency.name, dependency_call, request_param))
    if len({id(c) for _, c, _ in dependencies}) != len(dependencies):
        return None
    return _Shape(call, dependant.request_param_name, body.name, model, tuple(dependencies))


def _other_params(dependant: Dependant) -> bool:
    return bool(
        dependant.path_params
        or dependant.query_params
        or dependant.header_params
        or dependant.cookie_params
        or dependant.websocket_param_name
        or dependant.http_connection_param_name
        or dependant.response_param_name
        or dependant.background_tasks_param_name
        or dependant.security_scopes_param_name
        or dependant.own_oauth_scopes
    )
