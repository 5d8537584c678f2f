"""A real HTTP server on 127.0.0.1 that answers from a script: for the engine answers the simulator never gives
(contract breaches, cut streams, older server versions), so the adapters' error paths run over real sockets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass(frozen=True)
class Seen:
    """One request the server received."""

    method: str
    path: str
    query: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass(frozen=True)
class Answer:
    """What to answer. `cut`: send `body` as the start of a streamed answer, then drop the connection."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    cut: bool = False


Handler = Callable[[Seen], Answer]


def sse_body(*events: Any, done: bool = True) -> bytes:
    """Server-sent events, one `data:` line each, then `[DONE]` unless `done` is False."""
    body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


def replying(body: bytes, status: int = 200, *, cut: bool = False) -> Handler:
    """A handler that gives every request the same answer."""
    return lambda _: Answer(status, body, cut=cut)


@dataclass
class ScriptedServer:
    handler: Handler
    url: str = ""
    seen: list[Seen] = field(default_factory=list)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.path, dict(request.query), await request.read())
        self.seen.append(seen)
        answer = self.handler(seen)
        if not answer.cut:
            return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type)
        response = web.StreamResponse(status=answer.status, headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(answer.body)
        assert request.transport is not None
        request.transport.abort()  # a reset mid-body: the client sees a broken stream, not an end
        return response


@contextlib.asynccontextmanager
async def scripted_server(handler: Handler) -> AsyncIterator[ScriptedServer]:
    """Serve `handler` on an ephemeral 127.0.0.1 port for the duration of the block."""
    server = ScriptedServer(handler)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server._handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    sockets = site._server.sockets if site._server is not None else ()  # type: ignore[union-attr]
    server.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        await runner.cleanup()
