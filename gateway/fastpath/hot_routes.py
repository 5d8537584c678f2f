"""`HotRoutes`: the hot routes' ordinary requests served from the app's entry, past FastAPI's router and wrappers.

A short `POST /generate` went through eleven ASGI layers before its handler: Starlette's and FastAPI's app calls,
the error, telemetry and body-limit middlewares, the gateway's two, the exception middleware, an exit stack, the
router's matching over every route, and FastAPI's per-route wrappers; together a visible share of the gateway's CPU
on that request. For a request to one of the `OnePassRoute` routes (`gateway.fastpath.one_pass_route`) that declares a
content-length within the body limit and whose body the lean path accepts, the lane keeps only what decides anything
for such a request, from the middlewares the app stack is built with, in one layer instead of three (each wraps
`send` and adds its frames to every request), with the app's handlers and in their order:

* Starlette's `ExceptionMiddleware`: an error the app has a handler for (a `GatewayError`, an `HTTPException`)
  becomes that handler's answer, or a `RuntimeError` if the response had already started;
* the gateway's `RequestMetrics`: every request counted once, by route template and status (500 for an error that
  escapes, 499 for a request that ends without a response);
* Starlette's `ServerErrorMiddleware`: any other error answers the app's 500 (if no response started), then
  re-raises;

and calls the route's dependencies and endpoint (`OnePassCall.respond`). What it leaves out cannot act on such a
request: the body limit refuses only bodies over it (the declared length is within it, and HTTP/1.1 framing holds
the body to it); FastAPI's own body limit, form limits and OpenTelemetry are off; the router would pick this very
route (checked when the lane is built). Everything else goes to the full stack: another method or path, no or an
oversized content-length, a body the lean path leaves to FastAPI (the body read so far is replayed), dependency
overrides, an app whose middlewares or settings differ from what `create_app` builds (then no lane at all).
`tests/gateway/fastpath/test_one_pass_route.py` compares the answers and the request counts with an app served by
FastAPI alone.

What it pays (`benchmarks.ab . . --together --set-b RG_FASTPATH__HOT_ROUTES=false`, 4 rounds, 2-core host, 83d6584):
with it off the gateway spends 1.14× the CPU per `multiturn` chat request and 1.06× per streamed `rl` token.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.limits import BodySizeLimit
from gateway.api.observability import DISCONNECTED, RequestMetrics, count_request
from gateway.api.streaming import SERVER_SEND
from gateway.fastpath.one_pass_route import OnePassCall, OnePassRoute, one_pass_call

try:
    from fastapi.routing import iter_route_contexts

    _ROUTE_CONTEXTS = True
except ImportError:  # pragma: no cover - an older FastAPI: no lane, the full stack serves every request
    _ROUTE_CONTEXTS = False

try:
    from starlette._utils import is_async_callable  # how Starlette tells an async handler (partials included)
except ImportError:  # pragma: no cover - a Starlette that moved it
    is_async_callable = inspect.iscoroutinefunction  # type: ignore[assignment]

__all__ = ["HotRoutes"]

logger = logging.getLogger(__name__)

_PLAIN_CALL = Response.__call__
"""How a plain `Response` sends itself (its head, then its whole body); the lane sends such answers directly."""


@dataclass(frozen=True, slots=True)
class _Lane:
    """One hot route: what the router would put in the scope for it, and its lean path."""

    route: OnePassRoute
    call: OnePassCall


class HotRoutes:
    """Serves the ordinary requests of the app's `OnePassRoute` routes (see the module docstring); `full` serves the
    rest. Build it with `HotRoutes.of(app, full)`, once the app's routes, middlewares and handlers are final."""

    def __init__(
        self,
        app: FastAPI,
        lanes: Mapping[str, _Lane],
        max_body_bytes: int,
        full: ASGIApp,
        *,
        debug: bool,
    ) -> None:
        self._app = app
        self._lanes = dict(lanes)
        self._max_body_bytes = max_body_bytes
        self._full = full
        error_handler, handlers = _split_handlers(app)
        self._server_error = ServerErrorMiddleware(full, handler=error_handler, debug=debug)
        # The handlers as `ExceptionMiddleware` holds them, its defaults (plain HTTPException answers) included.
        exceptions = ExceptionMiddleware(full, handlers=handlers, debug=debug)
        self._status_handlers: dict[int, Any] = dict(exceptions._status_handlers)
        self._exception_handlers: dict[Any, Any] = dict(exceptions._exception_handlers)

    @classmethod
    def of(cls, app: FastAPI, full: ASGIApp) -> HotRoutes | None:
        """The lane of `app` (as `create_app` builds it), or None if the app is not built that way."""
        max_body_bytes = _body_limit(app)
        if max_body_bytes is None or not _ROUTE_CONTEXTS:
            return None
        if getattr(app, "max_body_size", None) is not None or app.root_path:
            return None
        try:
            lanes = _lanes(app)
            return cls(app, lanes, max_body_bytes, full, debug=app.debug) if lanes else None
        except Exception:  # a FastAPI or Starlette whose internals look otherwise: serve everything the usual way
            logger.warning("the fast lane is off: this FastAPI's routes or middlewares look otherwise", exc_info=True)
            return None

    @property
    def paths(self) -> frozenset[str]:
        """The paths the lane serves (POST only)."""
        return frozenset(self._lanes)

    def serves(self, scope: Scope) -> bool:
        """Whether the request may take the lane, on its method and path alone (the lane may still hand it on)."""
        return scope["method"] == "POST" and scope["path"] in self._lanes and not scope.get("root_path")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self._lanes[scope["path"]]
        length, content_type = length_and_type(scope["headers"])
        if not self._admits(lane, length):
            await self._full(scope, receive, send)
            return
        messages: list[Message] = []
        while True:
            try:
                message = await receive()
            except asyncio.CancelledError:  # a shutdown past its grace period: counted as the stack counts it
                scope["app"], scope["route"] = self._app, lane.route
                count_request(scope, DISCONNECTED)
                raise
            messages.append(message)
            if message["type"] != "http.request":  # the client left: the full stack answers as it does
                await self._full(scope, _replaying(messages, receive), send)
                return
            if not message.get("more_body", False):
                break
        body = messages[0].get("body", b"") if len(messages) == 1 else b"".join(m.get("body", b"") for m in messages)
        value = lane.call.parse(body, None if content_type is None else content_type.decode("latin-1"))
        if value is None:
            await self._full(scope, _replaying(messages, receive), send)
            return
        await self._serve(self._enter(scope, lane), lane.call, value, receive, send)

    def _admits(self, lane: _Lane, content_length: bytes | None) -> bool:
        """A declared length within the body limit, and no reason for FastAPI to serve the request itself."""
        return self._within_limit(content_length) and not lane.call.bypassed()

    def _within_limit(self, content_length: bytes | None) -> bool:
        return content_length is not None and content_length.isdigit() and int(content_length) <= self._max_body_bytes

    def _enter(self, scope: Scope, lane: _Lane) -> Scope:
        """`scope` with what the app and its router would have put in it for this route."""
        scope["app"] = self._app
        scope["route"] = lane.route
        scope["endpoint"] = lane.route.endpoint
        scope["path_params"] = {}
        return scope

    async def _serve(self, scope: Scope, call: OnePassCall, value: Any, receive: Receive, send: Send) -> None:
        """Dependencies and endpoint on the parsed body, under the error handling and counting of the app's
        middlewares (see the module docstring)."""
        status = 0  # of the response, once its head went out

        async def tracking(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        request = Request(scope, receive, send)
        try:
            try:
                response = await call.respond(request, value)
                if type(response).__call__ is _PLAIN_CALL and response.background is None:
                    # What `Response.__call__` sends, sent here: no wrapper around `send` for a plain answer.
                    status = response.status_code
                    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
                    await send({"type": "http.response.body", "body": response.body})
                else:
                    await response(scope, receive, tracking)
            except Exception as exc:
                handler = self._handler(exc)
                if handler is None:
                    raise
                if status:
                    raise RuntimeError("Caught handled exception, but response already started.") from exc
                answer = await _call_handler(handler, request, exc)
                if answer is not None:
                    await answer(scope, receive, tracking)
                exc.__traceback__ = None  # a reused exception instance would gather tracebacks across requests
        except Exception as exc:
            if not status:
                status = 500
                await (await self._server_error_answer(scope, exc))(scope, receive, send)
            raise
        finally:
            count_request(scope, status or DISCONNECTED)
            scope.pop(SERVER_SEND, None)  # set by `GatewayApp`: see `GatewayApp.__call__`

    def _handler(self, exc: Exception) -> Any:
        """The app's handler of `exc` (as `ExceptionMiddleware` looks it up), or None."""
        if isinstance(exc, HTTPException):
            handler = self._status_handlers.get(exc.status_code)
            if handler is not None:
                return handler
        for cls in type(exc).__mro__:
            if cls in self._exception_handlers:
                return self._exception_handlers[cls]
        return None

    async def _server_error_answer(self, scope: Scope, exc: Exception) -> Any:
        """The answer `ServerErrorMiddleware` gives an error nothing handled: the app's 500 handler's, its own plain
        500, or the traceback page in debug mode."""
        errors, request = self._server_error, Request(scope)
        if errors.debug:
            return await run_in_threadpool(errors.debug_response, request, exc)
        if errors.handler is None:
            return errors.error_response(request, exc)
        return await _call_handler(errors.handler, request, exc)


def length_and_type(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
    """The first content-length and content-type values of a request's headers (names in lowercase, as servers
    hand them to ASGI apps), each None where absent."""
    length = content_type = None
    for name, value in headers:
        if name == b"content-length":
            length = value if length is None else length
        elif name == b"content-type":
            content_type = value if content_type is None else content_type
    return length, content_type


async def _call_handler(handler: Any, request: Request, exc: Exception) -> Any:
    """An exception handler's answer; a plain `def` handler runs in the thread pool, as Starlette runs it."""
    if is_async_callable(handler):
        return await handler(request, exc)
    return await run_in_threadpool(handler, request, exc)


def _body_limit(app: FastAPI) -> int | None:
    """The body limit of an app whose middlewares are exactly the gateway's (`create_app`), else None."""
    stack: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [(m.cls, m.args, m.kwargs) for m in app.user_middleware]
    if len(stack) != 2 or stack[0] != (RequestMetrics, (), {}):
        return None
    cls, args, kwargs = stack[1]
    if cls is not BodySizeLimit or args or set(kwargs) != {"max_bytes"}:
        return None
    max_bytes = kwargs["max_bytes"]
    return max_bytes if isinstance(max_bytes, int) else None


def _split_handlers(app: FastAPI) -> tuple[Any, dict[Any, Any]]:
    """The app's exception handlers as FastAPI's stack splits them: the 500 one (for `ServerErrorMiddleware`) and
    the others (for `ExceptionMiddleware`)."""
    error_handler = None
    handlers: dict[Any, Any] = {}
    for key, value in app.exception_handlers.items():
        if key in (500, Exception):
            error_handler = value
        else:
            handlers[key] = value
    return error_handler, handlers


def _lanes(app: FastAPI) -> dict[str, _Lane]:
    """The app's `OnePassRoute` routes of one method (POST) and a fixed path, with a lean path, that the router would
    pick for a POST to their path (no earlier route matches it)."""
    contexts = list(iter_route_contexts(app.routes))
    lanes: dict[str, _Lane] = {}
    for index, context in enumerate(contexts):
        route = context.original_route
        if not isinstance(route, OnePassRoute) or context.methods != {"POST"}:
            continue
        path = context.path
        if not isinstance(path, str) or "{" in path or getattr(context, "max_body_size", None) is not None:
            continue
        call = one_pass_call(context._route_context or route)
        if call is None:
            continue
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
        first = next((c for c in contexts if c.matches(scope)[0] != Match.NONE), None)
        if first is contexts[index] and context.matches(scope)[0] == Match.FULL:
            lanes[path] = _Lane(route, call)
    return lanes


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first hands out `messages` again (what the lane read of the request)."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
