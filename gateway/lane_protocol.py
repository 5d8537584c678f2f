"""`LaneProtocol`: the gateway's server protocol. A hot route's ordinary request reaches the app's fast lane with its
whole body, past the steps of uvicorn's that only a generic ASGI app needs.

For every request, uvicorn's httptools protocol parses the URL into an object, makes an `asyncio.Event` and a
`RequestResponseCycle`, and starts a task that calls the ASGI app from the moment the headers are in; the app then
asks for the body with `receive()` (a coroutine, an event wait, a message dict, the body copied into a bytearray and
out again). For a `POST` to one of the paths of the app's `FastLane` (`gateway.api.fast_lane`), written exactly (no
query, no escapes), with a content-length that the lane takes, this protocol keeps the body's pieces as they arrive
and, once the body is whole, starts the task that hands it to the lane directly (`FastLane.serve_read`).

The request's cycle is still uvicorn's own class (`LaneCycle`, whose event is made only if something awaits
`receive`), so everything after the body is read is uvicorn's: answers through `send` (or `send_whole_answer`),
flow control, keep-alive, disconnects, graceful shutdown, the 500 of an app that fails. Everything else goes
uvicorn's way unchanged: other methods and paths, a request pipelined behind one still being answered, `Expect:
100-continue`, upgrades, a concurrency limit or a root path, an app that is not a `GatewayApp` (uvicorn wraps it
when it reads proxy headers or logs at trace level), a uvicorn without the method this relies on.

A lane request also gets a disconnect notice in its scope (`common.asgi.DisconnectNotice`), which the protocol
tells when the connection is lost before the answer completed: the request's disconnect watch names a listener on
it instead of starting a watcher task (after a delay), and a client that leaves is noticed at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, cast

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from common.asgi import DISCONNECT_NOTICE, DisconnectNotice
from gateway.api.fast_lane import FastLane, length_and_type
from gateway.api.streaming import GatewayApp
from gateway.http_protocol import HeadWithBodyProtocol

__all__ = ["LaneCycle", "LaneProtocol"]

_STARTS_TASKS = hasattr(HttpToolsProtocol, "_start_asgi_task")
"""Whether this uvicorn starts a cycle's task the way the lane relies on (a private method of its protocol)."""


class _Unawaited:
    """The event of a cycle whose `receive` nobody awaited yet. Each `set()` comes with a flag that `receive` reads
    before it waits (`disconnected`, `response_complete`), so until something waits there is nothing to wake."""

    __slots__ = ()

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


_UNAWAITED = cast(asyncio.Event, _Unawaited())


class LaneCycle(RequestResponseCycle):
    """uvicorn's request cycle for a lane request: its body gathered by the protocol (`parts`) and served by
    `serve`, its event made at the first `receive`, and the request's disconnect notice (`notice`, also in the
    scope)."""

    def __init__(self, protocol: LaneProtocol, lane: FastLane, content_type: bytes | None, keep_alive: bool) -> None:
        super().__init__(
            scope=protocol.scope,
            transport=protocol.transport,
            flow=protocol.flow,
            logger=protocol.logger,
            access_logger=protocol.access_logger,
            access_log=protocol.access_log,
            default_headers=protocol.server_state.default_headers,
            message_event=_UNAWAITED,
            expect_100_continue=False,
            keep_alive=keep_alive,
            on_response=protocol.on_response_complete,
        )
        self.lane = lane
        self.content_type = content_type
        self.parts: list[bytes] = []
        self.notice = DisconnectNotice()

    def serve(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The ASGI app of this request (`run_asgi` awaits what it returns): the whole body to the lane. A plain
        function returning the lane's awaitable, so the request's task runs no coroutine of its own here."""
        parts, self.parts = self.parts, []  # the cycle outlives the request (until the connection's next one)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        return self.lane.serve_read(scope, body, self.content_type, receive, send)

    async def receive(self) -> Any:
        if self.message_event is _UNAWAITED:
            self.message_event = asyncio.Event()
        return await super().receive()


class LaneProtocol(HeadWithBodyProtocol):
    """`HeadWithBodyProtocol` whose lane requests are read whole before their task starts (see the module
    docstring); `uvicorn.Config(http=LaneProtocol)`."""

    _reading: LaneCycle | None = None
    """The lane request whose body is arriving."""

    def on_headers_complete(self) -> None:
        cycle = self._lane_cycle()
        if cycle is None:
            super().on_headers_complete()
        else:
            self.cycle = self._reading = cycle

    def on_body(self, body: bytes) -> None:
        cycle = self._reading
        if cycle is None:
            super().on_body(body)
        else:
            cycle.parts.append(body)

    def on_message_complete(self) -> None:
        cycle = self._reading
        if cycle is None:
            super().on_message_complete()
            return
        self._reading = None
        cycle.more_body = False
        # An ASGI app (uvicorn's typing names its own scopes); no `cast`, which is a function call at run time.
        self._start_asgi_task(cycle, cycle.serve)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle, self._reading = self._reading, None
        current = self.cycle
        super().connection_lost(exc)
        if type(current) is LaneCycle and current.disconnected:
            current.notice.client_left(self.loop)
        if cycle is not None:
            # The client left before its body was whole: the app hears of the request, and of the disconnect at
            # its first `receive`, as it does when uvicorn's own task has been waiting for the body all along.
            self._start_asgi_task(cycle, self.app)

    def _lane_cycle(self) -> LaneCycle | None:
        """A cycle for this request if it takes the lane (the scope completed as uvicorn completes it), else None."""
        app = self.app
        if not _STARTS_TASKS or type(app) is not GatewayApp or self.root_path or self.expect_100_continue:
            return None
        if self.limit_concurrency is not None or (self.cycle is not None and not self.cycle.response_complete):
            return None  # uvicorn may answer 503, or queues a pipelined request
        parser = self.parser
        if parser.get_method() != b"POST" or parser.should_upgrade():
            return None
        lane: FastLane | None = app.lane()
        url = self.url
        if lane is None or url not in lane.raw_paths:
            return None
        path = url.decode("ascii")
        length, content_type = length_and_type(self.headers)
        if not lane.takes(path, length):
            return None
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = "POST"
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = path
        scope["raw_path"] = url
        scope["query_string"] = b""
        cycle = LaneCycle(self, lane, content_type, http_version != "1.0" and parser.should_keep_alive())
        scope[DISCONNECT_NOTICE] = cycle.notice  # type: ignore[literal-required]  # an extension key of ours
        return cycle
