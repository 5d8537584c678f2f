"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, each response's head sent with its body, and
idle keep-alive connections closed by one timer per event loop.

uvicorn writes a response's status line and headers to the socket as soon as the app sends `http.response.start`,
and the body in a second write: two `send` syscalls and two TCP segments (the socket is `TCP_NODELAY`) for every
JSON answer, and for every stream's head before its first event. `HeadWithBodyProtocol` hands uvicorn a transport
that holds a head back until the next write, which then goes out with it in one `writelines` (one syscall), or until
the event loop's next pass when nothing follows in the same one (a stream still waiting for its first event gets its
head at once, as before). Nothing else changes: the bytes, their order, flow control, closing.

uvicorn also arms a keep-alive timer at the end of every response and cancels it when the next request arrives: with
uvloop, a libuv timer handle made and torn down per request (visible in a profile of short requests). Here a
response only stamps its connection idle; an `_IdleSweeper` per loop closes the connections idle for the whole
`timeout_keep_alive`, checking every quarter of it, so an idle connection closes at most 1.25 times the timeout late.

A whole answer whose headers the gateway built itself (`send_whole_answer`) skips uvicorn's `send` altogether: its
head and body go out in one write, without the two ASGI messages, the header checks a head of the application's gets
and the loop pass a held head waits for (docs/benchmarks.md has what that saves on a short request).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle
except ImportError:  # pragma: no cover - a uvicorn that moved them: every answer goes through `send`
    RequestResponseCycle = None  # type: ignore[assignment,misc]

from common.loop_local import loop_local

__all__ = ["HeadWithBodyProtocol", "HeadWithBodyTransport", "send_whole_answer"]

_HEAD = b"HTTP/1.1 "  # how every head uvicorn writes begins (its status lines, 100 Continue, its own 4xx/5xx)


class HeadWithBodyTransport(asyncio.Transport):
    """`transport`, except that a write starting like a response head waits for the next write (or the loop's next
    pass, or a close) and goes out together with it. Holding a write that only looks like a head is harmless: it is
    sent just as promptly, in order."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.writelines((held, data))
        elif data[:9] == _HEAD:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.flush()
        self._transport.writelines(list_of_data)

    def flush(self) -> None:
        """Send a held head now (a no-op when none is held, or when the connection is already closing)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.flush()
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + (len(self._held) if self._held is not None else 0)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class HeadWithBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `HeadWithBodyTransport` (`uvicorn.Config(http=HeadWithBodyProtocol)`), its
    idle keep-alive connections closed by the loop's `_IdleSweeper` instead of a timer per response."""

    idle_since: float | None = None
    """Loop time the connection's last response completed, while no new request has arrived since."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not `asyncio.Transport` subclasses, but they have its methods.
        super().connection_made(HeadWithBodyTransport(cast(asyncio.Transport, transport), self.loop))
        self._sweeper = loop_local(_IdleSweeper, float(self.timeout_keep_alive))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._sweeper.forget(self)

    def on_response_complete(self) -> None:
        if self.pipeline or self.transport.is_closing() or self.timeout_keep_alive <= 0:
            # A pipelined request starts, or a closing connection is left (no timer either way), or a connection
            # that closes as soon as it is idle gets uvicorn's own zero-delay timer (a sweep every 0 s would spin).
            super().on_response_complete()
            return
        # uvicorn's steps, the keep-alive timer aside.
        self.server_state.total_requests += 1
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        self.idle_since = self.loop.time()
        self._sweeper.watch(self)

    def _unset_keepalive_if_required(self) -> None:
        """Data arrived, the connection closes, or a response completed: the connection is no longer idle."""
        self.idle_since = None
        if self.timeout_keep_alive_task is not None:  # armed by uvicorn's path only (a zero timeout)
            super()._unset_keepalive_if_required()


class _IdleSweeper:
    """Closes the kept-alive connections of one event loop idle for `timeout` seconds, checking every quarter of it
    while any is open (see the module docstring)."""

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.interval = max(timeout / 4, 0.05)  # a timeout under 0.2 s is checked every 50 ms, not spun on
        self.connections: set[HeadWithBodyProtocol] = set()
        self.armed = False

    def watch(self, protocol: HeadWithBodyProtocol) -> None:
        self.connections.add(protocol)
        if not self.armed:
            self.armed = True
            self.loop.call_later(self.interval, self._sweep)

    def forget(self, protocol: HeadWithBodyProtocol) -> None:
        self.connections.discard(protocol)

    def _sweep(self) -> None:
        now = self.loop.time()
        for protocol in list(self.connections):
            idle_since = protocol.idle_since
            if idle_since is not None and now - idle_since >= self.timeout:
                self.connections.discard(protocol)
                protocol.timeout_keep_alive_handler()  # uvicorn's: close the transport unless it is closing
        if self.connections:
            self.loop.call_later(self.interval, self._sweep)
        else:
            self.armed = False


_CYCLE_FIELDS = (
    "response_started",
    "response_complete",
    "disconnected",
    "flow",
    "access_log",
    "scope",
    "waiting_for_100_continue",
    "default_headers",
    "keep_alive",
    "transport",
    "message_event",
    "on_response",
)
"""The state of uvicorn's request cycle that `send_whole_answer` reads and sets, as `send` does."""

_cycle_known: bool | None = None  # whether this uvicorn's cycle has `_CYCLE_FIELDS` (checked on the first answer)


def send_whole_answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview) -> bool:
    """Send a complete answer in one socket write, past uvicorn's `send`, if `send` is the `send` of uvicorn's
    request cycle and nothing has been sent yet; False (nothing sent) otherwise: send it through `send` then.

    `headers` must be what uvicorn's checks would pass unchanged: lowercase names of token characters, values without
    control characters, a `content-length` equal to `len(body)`, no `connection` or `transfer-encoding` (the gateway
    builds them itself: `JSONAnswer`). What `send` adds or does besides is done here alike: the server's default
    headers (`date`), `connection: close` and the close when the connection is not kept alive, the end of the
    response for the protocol. A paused writer (the client reads slowly), a gone client, a HEAD request or an access
    log leave the answer to `send`."""
    global _cycle_known
    cycle = getattr(send, "__self__", None)
    if RequestResponseCycle is None or not isinstance(cycle, RequestResponseCycle):  # the gateway's `LaneCycle` too
        return False
    if _cycle_known is None:
        _cycle_known = all(hasattr(cycle, name) for name in _CYCLE_FIELDS)
    if (
        not _cycle_known
        or cycle.response_started
        or cycle.disconnected
        or cycle.flow.write_paused
        or cycle.access_log
        or cycle.scope["method"] == "HEAD"
    ):
        return False
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    parts: list[bytes | memoryview] = [STATUS_LINE[status]]
    for name, value in cycle.default_headers:
        parts += (name, b": ", value, b"\r\n")
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    keep_alive = cycle.keep_alive
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", body)
    transport = cycle.transport
    transport.writelines((b"".join(parts),))  # not `write`: a `HeadWithBodyTransport` would hold it as a head alone
    cycle.response_complete = True
    cycle.message_event.set()
    if not keep_alive:
        transport.close()
    cycle.on_response()
    return True
