"""Streaming responses of the gateway: cleanup that always runs, and the seam of a body path that skips the
middleware chain.

With the fast path's `server_send` part (`gateway.fastpath.server_send`, set as `GatewayApp.abort_client`), body
chunks go straight to the server's own `send`, which `GatewayApp` then puts in the scope, once the head went through
the middlewares; a client cut for reading too slowly has its connection aborted. Without it, chunks pass through
every middleware. Flow control is the server's (uvicorn waits for the socket to drain inside its `send`), in a writer
task of the response's own (`gateway.api.client_writer`): the generation never waits for the client. The writers of
an app count what they hold in its services' `stream_buffers`, against `server.stream_buffer_budget_bytes`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Literal, Protocol

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from common.asgi import ClientDisconnected, unless_disconnected
from gateway.api.client_writer import ClientWriter, SlowClient, StreamBuffers
from gateway.api.context import ApiServices
from gateway.config import ServerConfig

logger = logging.getLogger(__name__)


class LastChunk(bytes):
    """The last body chunk of a streamed response (`[DONE]`, say): `GuardedStreamingResponse` sends it as the end
    of the body, so the chunked encoding's terminator goes out in the same socket write instead of one of its own."""


DISCONNECT_WATCH_AFTER_S = 0.25
"""How long a request that FastAPI serves itself runs before the gateway starts watching for its client's disconnect
(`common.asgi`): most requests end sooner and never pay for a watcher task; a client that leaves is noticed at most
1.25 times this late, and the engine request it abandoned is aborted then."""


SERVER_SEND = "rollout_gateway.server_send"
"""The scope key under which the app keeps the server's `send` (for `GuardedStreamingResponse`'s body), when it has
an `abort_client`."""

AbortClient = Callable[[Send], None]
"""Closes at once the connection the server's `send` answers on (the fast path's `server_send`)."""


class Shortcut(Protocol):
    """Serves some requests from the app's entry instead of the full stack (the fast path's hot routes)."""

    def serves(self, scope: Scope) -> bool: ...

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


ShortcutFactory = Callable[["GatewayApp", ASGIApp], "Shortcut | None"]
"""Builds an app's shortcut from the app and its full stack (None: the app has none)."""


class GatewayApp(FastAPI):
    """FastAPI that, given an `abort_client` (the fast path's `server_send`), keeps the server's `send` in the scope
    (`SERVER_SEND`) for `GuardedStreamingResponse`, and serves the requests its `shortcut` takes through it (built by
    `shortcut_factory` at the first request, when the routes, middlewares and handlers are final; the fast path's
    hot routes, `gateway.fastpath.hot_routes`).

    The `send` kept is the one this app was called with, so middlewares *around* the app still see every
    message; middlewares added *to* it (`add_middleware`) see only the head of a stream, and so must not
    transform response bodies (compression, say): none of the gateway's does.
    """

    _shortcut: Shortcut | None | Literal[False] = False  # False: not built yet
    shortcut_factory: ShortcutFactory | None = None
    abort_client: AbortClient | None = None
    services: ApiServices | None = None
    """The running services, set by the lifespan beside `state.services` (a plain attribute: Starlette's `State`
    finds its entries by raising and catching an AttributeError, at every read)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.abort_client is not None:
            scope[SERVER_SEND] = send
        try:
            if scope["type"] == "http":
                shortcut = self._shortcut
                if shortcut is False:
                    shortcut = self.shortcut()
                if shortcut is not None and shortcut.serves(scope):
                    await shortcut(scope, receive, send)
                    return
            await super().__call__(scope, receive, send)
        finally:
            # The server's `send` is a method of its request cycle, which holds the scope: left here, the two would
            # make a reference cycle per request, the cycle's whole state (headers, events) garbage that only the
            # cyclic collector frees.
            scope.pop(SERVER_SEND, None)

    def shortcut(self) -> Shortcut | None:
        """The shortcut (built at the first call, when the routes, middlewares and handlers are final), or None."""
        shortcut = self._shortcut
        if shortcut is False:
            factory = self.shortcut_factory
            shortcut = self._shortcut = factory(self, self._stack) if factory is not None else None
        return shortcut

    @property
    def built_shortcut(self) -> Shortcut | None:
        """The shortcut, once the first request built it (None before, and for an app without one)."""
        return self._shortcut or None

    async def _stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app as FastAPI serves it: every middleware, the router, the route's own handler."""
        await super().__call__(scope, receive, send)


class GuardedStreamingResponse(StreamingResponse):
    """`StreamingResponse` + `on_close`, awaited however the response ends; body chunks bypass the middlewares.

    A client that leaves ends the response: while the head is sent, a watcher (from `DISCONNECT_WATCH_AFTER_S` on)
    cancels a send that never returns; while the body streams, its relay (`common.asgi.relay_until_disconnected`)
    notices the disconnect and closes the generation. Starlette's own watch (for servers of ASGI spec < 2.4,
    uvicorn's included) would run the body in an anyio task group beside a task that waits for the disconnect from
    the start, and cancel it at the end: a task and a task group more per streamed response.

    If the response ends before its body generator started (a client gone while the head was sent), the
    generator's own `finally` never runs: cleanup that must happen (releasing a session's turn lock, recording the
    turn) therefore lives here, not only in the generator.
    """

    def __init__(self, content: AsyncIterable[bytes], on_close: Callable[[], Awaitable[None]], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        try:
            try:
                await unless_disconnected(Request(scope, receive), send(head), _nothing, DISCONNECT_WATCH_AFTER_S)
            except ClientDisconnected:
                return  # nobody is left to read the body
            app = scope.get("app")
            gateway = app if isinstance(app, GatewayApp) else None
            server_send = scope.get(SERVER_SEND)  # there only when the app has an `abort_client`
            limits, buffers = _limits(gateway)
            writer = ClientWriter(
                server_send or send, limits.stream_buffer_bytes, limits.slow_client_timeout_s, buffers
            )
            try:
                await self._relay(writer, send)
            except SlowClient as exc:
                logger.warning("streamed answer cut: %s", str(exc))  # the text: a record keeps no frame
                if server_send is not None and gateway is not None and gateway.abort_client is not None:
                    gateway.abort_client(server_send)
                # else the response returns without its end, and the server closes the connection
            finally:
                writer.close()
            if self.background is not None:
                await self.background()
        finally:
            await self.on_close()

    async def _relay(self, writer: ClientWriter, send: Send) -> None:
        """Run the body generator to its end in this task, its chunks queued to `writer` (never waiting for the
        client), then send the end of the body. A client cut (`SlowClient`) closes the generator: the generation
        stops and its turn is recorded as cancelled, as for a client that left."""
        body = self.body_iterator
        last = b""  # a `LastChunk`, held for the end of the body (the generator runs on to its own end)
        finished = False
        try:
            async for chunk in body:
                if last:  # anything after a LastChunk: the held one was not the last after all
                    writer.put(last)
                    last = b""
                if type(chunk) is LastChunk:
                    last = chunk
                elif isinstance(chunk, bytes):
                    writer.put(chunk)
                else:  # Starlette's body types: text, or a memoryview (none of the gateway's)
                    writer.put(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
            finished = True
        finally:
            if not finished:
                aclose = getattr(body, "aclose", None)
                if aclose is not None:
                    await aclose()
        await writer.finish(last, send)


def _limits(app: GatewayApp | None) -> tuple[ServerConfig, StreamBuffers]:
    """The server settings of `app` and its process's stream buffers (the defaults for an app without services:
    tests' own)."""
    services = app.services if app is not None else None
    if services is None:
        return _DEFAULT_LIMITS, _DEFAULT_BUFFERS
    return services.settings.server, services.stream_buffers


_DEFAULT_LIMITS = ServerConfig()
_DEFAULT_BUFFERS = StreamBuffers(_DEFAULT_LIMITS.stream_buffer_budget_bytes)


def _nothing() -> None:
    """What a response does at the moment its client leaves: nothing more than stop sending."""
