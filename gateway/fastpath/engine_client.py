"""Generation requests to one replica over kept-alive HTTP/1.1 connections, without a general client's per-call work.

aiohttp's `ClientSession.request` runs a lot of Python on every call (URL and header objects, cookie filtering,
trace hooks, a writer task, timer contexts): a large share of all the gateway does for a 1–8-token answer, and most
of what dispatching a continuation costs after a weight update, a thousand of them at once. A generation request
needs none of it: one POST of an encoded JSON body to a path known in advance, and one answer framed by
Content-Length or chunked encoding, read whole or as it streams. `KeepAlivePool` writes that request in one socket
write on an idle connection and parses the answer with httptools (llhttp, the parser uvicorn serves with)
(`benchmarks/engine_client.py`, docs/benchmarks.md). Control calls (health, pause, weights, metrics) stay on aiohttp
(`backends.http_client`).

Failures are the standard library's, for `translate_errors` to map: `ConnectionError` (refused, reset, closed
before the answer ended, the pool closed), `TimeoutError` (connect, pool wait, a whole answer not complete within
the read timeout) and `ValueError` (an answer that is not HTTP). An answer not read to its end (a failure, a
timeout, a cancelled caller, a stream left early) closes its connection, which the engines take as a client
disconnect: they abort the request.

What it pays (`benchmarks.ab . . --together --set-b RG_FASTPATH__ENGINE_CLIENT=false`, 4 rounds, 2-core host, 83d6584):
with it off the gateway spends 1.15× the CPU per `multiturn` chat request and 1.17× per streamed `rl` token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import Mapping
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

import httptools

from backends.generation_transport import IDLE_EXPIRY_S

__all__ = ["KeepAlivePool", "StreamedAnswer"]

STREAM_BUFFER_BYTES = 1 << 16
"""A streamed answer's bytes held for a reader that is behind, beyond which the socket is no longer read."""

_REQUEST = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
_ACCEPT_EVENTS = b"Accept: text/event-stream\r\n"


def _header_lines(headers: Mapping[str, str]) -> bytes:
    """Extra request headers as the lines of a request's head."""
    return b"".join(f"{name}: {value}\r\n".encode() for name, value in headers.items())


class _Connection(asyncio.Protocol):
    """One socket to the replica: at most one request in flight, its answer parsed as the bytes come.

    A whole answer (`send_whole`) completes the future `answer`; a streamed one (`send_streamed`) completes `head`
    with the status and then hands its body over in `pieces` (`read`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None  # a whole answer in flight
        self.head: asyncio.Future[int] | None = None  # a streamed answer in flight: its status
        self.body: list[bytes] = []  # of a whole answer
        self.pieces: list[bytes] = []  # of a streamed answer, not read yet
        self.buffered = 0
        self.reader: asyncio.Future[None] | None = None  # a read of a streamed answer waiting for bytes
        self.flow_paused = False  # this connection stopped reading its socket because the reader is behind
        self.streaming = False
        self.ended = False  # the streamed answer is complete
        self.error: Exception | None = None  # why the streamed answer broke off
        self.framed = False  # the answer's head gave Content-Length or Transfer-Encoding (else the close ends it)
        self.headers_done = False
        self.keep_alive = True
        self.lost = False
        self.idle_since = 0.0
        self.deadline = 0.0  # loop time by which the whole answer in flight must be complete
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # the loop time `_timer` fires at

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.answer is None and (not self.streaming or self.ended):  # bytes nobody asked for: give it up
            self._close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ValueError(f"the answer is not valid HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.headers_done and not self.framed:  # an answer whose end is the connection's close
            self._end()
            return
        self._break(ConnectionResetError("the replica closed the connection before its answer ended"))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            return  # interim (100 Continue, 103 Early Hints): the answer follows
        self.headers_done = True
        head = self.head
        if head is not None and not head.done():
            head.set_result(status)

    def on_body(self, body: bytes) -> None:
        if not self.streaming:
            self.body.append(body)
            return
        if self.ended:
            return  # an answer nobody asked for, after the stream's end (the connection is being closed)
        self.pieces.append(body)
        self.buffered += len(body)
        self._wake_reader()
        if self.buffered > STREAM_BUFFER_BYTES and not self.flow_paused and self.transport is not None:
            self.flow_paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200:
            self.body.clear()
            self.framed = False
            return
        self.keep_alive = self.parser.should_keep_alive()
        self._end()

    # -- the pool's side

    def send_whole(
        self, request: bytes, deadline: float, loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[tuple[int, bytes]]:
        """Write one request; the future gets (status, body) once the answer is complete. `loop`: the running loop."""
        self._reset(streaming=False)
        self.answer = loop.create_future()
        self.deadline = deadline
        # One timer per connection, moved on only when it fires (see `_check_deadline`), or re-armed for a deadline
        # sooner than it (a caller's own deadline, shorter than the read timeout a request before armed it for).
        if self._timer is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = loop.call_at(deadline, self._check_deadline), deadline
        self._write(request)
        return self.answer

    def send_streamed(self, request: bytes) -> asyncio.Future[int]:
        """Write one request; the future gets the answer's status once its head arrived (then `read` the body)."""
        self._reset(streaming=True)
        self.head = asyncio.get_running_loop().create_future()
        self._write(request)
        return self.head

    async def read(self) -> bytes:
        """The streamed answer's bytes that arrived since the last read (waiting for some); b"" once it ended."""
        while not self.pieces:
            if self.error is not None:
                raise self.error
            if self.ended:
                return b""
            self.reader = asyncio.get_running_loop().create_future()
            await self.reader
        pieces, self.pieces, self.buffered = self.pieces, [], 0
        if self.flow_paused:
            self.flow_paused = False
            if self.transport is not None and not self.lost:
                self.transport.resume_reading()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def usable(self, now: float, idle_expiry_s: float) -> bool:
        return not self.lost and self.keep_alive and now - self.idle_since < idle_expiry_s

    def reusable(self) -> bool:
        """The exchange in flight ended cleanly, nothing of it is left unread: another request may follow."""
        if self.streaming:
            return self.ended and self.error is None and not self.pieces and self.keep_alive and not self.lost
        return self.answer is None and self.keep_alive and not self.lost

    def _reset(self, streaming: bool) -> None:
        self.streaming = streaming
        self.body = []
        self.pieces = []
        self.buffered = 0
        self.ended = False
        self.error = None
        self.framed = self.headers_done = False

    def _write(self, request: bytes) -> None:
        assert self.transport is not None
        self.transport.write(request)

    def _check_deadline(self) -> None:
        self._timer = None
        if self.answer is None or self.answer.done():
            return  # idle, or a stream (timed by its reader): the next whole answer arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() < self.deadline:  # a later request than the one that armed it: wait for its own deadline
            self._timer, self._timer_at = loop.call_at(self.deadline, self._check_deadline), self.deadline
            return
        self._fail(TimeoutError("no complete answer within the read timeout"))

    def _end(self) -> None:
        """The answer in flight is complete."""
        if self.streaming:
            if self.ended:  # a second answer in the same bytes: nobody asked for it
                self._close()
                return
            self.ended = True
            self._wake_reader()
            return
        answer, self.answer = self.answer, None
        body, self.body = self.body, []
        if answer is None or answer.done():  # an answer nobody waits for (a second one in the same bytes, say)
            self._close()
            return
        answer.set_result((self.parser.get_status_code(), b"".join(body)))

    def _break(self, exc: Exception) -> None:
        """The answer in flight cannot complete: its waiter gets `exc`."""
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)
        if not self.streaming or self.ended:
            return
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        elif self.error is None:
            self.error = exc
            self._wake_reader()

    def _wake_reader(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None and not reader.done():
            reader.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self._break(exc)
        self._close()

    def _close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()


class StreamedAnswer:
    """An answer read as it streams (`KeepAlivePool.stream`): `async with` sends the request and waits for the head;
    then `status`, and `read` for the body in the pieces the socket delivered. Leaving the block before the answer
    ended closes the connection (the engine aborts the request); a connection read to the end is kept alive."""

    __slots__ = ("_body", "_connection", "_headers", "_path", "_pool", "status")

    def __init__(self, pool: KeepAlivePool, path: str, body: bytes, headers: bytes = _ACCEPT_EVENTS) -> None:
        self._pool = pool
        self._path = path
        self._body = body
        self._headers = headers
        self._connection: _Connection | None = None
        self.status = 0

    @property
    def transport(self) -> asyncio.Transport | None:
        """The socket being read (the read pacer holds it between ticks)."""
        return self._connection.transport if self._connection is not None else None

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read, waiting for some; b"" once the answer ended. Raises
        `ConnectionError` when the connection broke before the end."""
        assert self._connection is not None, "read within `async with`"
        return await self._connection.read()

    async def read_all(self) -> bytes:
        """The rest of the body."""
        pieces = []
        while data := await self.read():
            pieces.append(data)
        return b"".join(pieces)

    async def __aenter__(self) -> StreamedAnswer:
        pool = self._pool
        request = pool.request(self._path, self._body, self._headers)
        self._body = b""  # not held for the answer's length
        connection = self._connection = await pool.acquire()
        try:
            self.status = await connection.send_streamed(request)
        except BaseException:
            connection._close()
            pool.release(connection)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        connection = self._connection
        if connection is None:
            return
        self._connection = None
        self._pool.release(connection)  # kept alive if the answer was read to its end, else closed


class KeepAlivePool:
    """Kept-alive connections to one replica for generation POSTs, at most `limit` open at once.

    `post` sends a request and waits for the whole answer (at most `read_timeout_s`); `stream` reads one as it
    comes (its reader times the gaps). Each takes the most recently used idle connection, or opens one; callers
    beyond `limit` wait their turn in order, up to `pool_timeout_s`. A connection unused for `idle_expiry_s` is
    closed instead of reused. Making the pool does no I/O. `url` is the replica's base URL; a path in it prefixes
    every request's path. An https URL is verified against `tls` (default: the system's trusted certificates, as
    aiohttp does).
    """

    def __init__(
        self,
        url: str,
        limit: int,
        connect_timeout_s: float,
        pool_timeout_s: float,
        read_timeout_s: float,
        idle_expiry_s: float = IDLE_EXPIRY_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        if limit < 1:
            raise ValueError(f"a pool needs room for one connection at least, not {limit}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/").encode()
        self._host_header = parts.netloc.rpartition("@")[2].encode()
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self.pool_timeout_s = pool_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_expiry_s = idle_expiry_s
        self.opened = 0  # connections opened so far (reuse shows as requests per connection)
        self._idle: collections.deque[_Connection] = collections.deque()
        self._busy: set[_Connection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._idle) + len(self._busy) + self._opening

    async def post(
        self, path: str, body: bytes, deadline: float | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """POST `body` (encoded JSON) to `path`, with `headers` besides the pool's own; (status, body) of the whole
        answer. It must be complete within the read timeout and, if given, by `deadline` (loop time), else
        `TimeoutError`."""
        request = self.request(path, body) if headers is None else self.request(path, body, _header_lines(headers))
        del body  # neither is held for the answer's length
        connection = self._idle_connection()  # most requests find one idle: no coroutine of `acquire` for them
        if connection is None:
            connection = await self.acquire()
        loop = asyncio.get_running_loop()
        read_until = loop.time() + self.read_timeout_s
        answer = connection.send_whole(request, read_until if deadline is None else min(deadline, read_until), loop)
        del request
        try:
            status, content = await answer
        except BaseException:
            connection._close()  # an answer still on its way (or broken): the connection cannot be reused
            self.release(connection)
            raise
        self.release(connection)
        return status, content

    def stream(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> StreamedAnswer:
        """POST `body` (encoded JSON) to `path`, with `headers` besides the pool's own, for an answer read as it
        streams: `async with pool.stream(...) as answer`."""
        if headers is None:
            return StreamedAnswer(self, path, body)
        return StreamedAnswer(self, path, body, _ACCEPT_EVENTS + _header_lines(headers))

    def request(self, path: str, body: bytes, extra_headers: bytes = b"") -> bytes:
        """The bytes of one POST."""
        return _REQUEST % (self._prefix, path.encode(), self._host_header, len(body), extra_headers, body)

    async def acquire(self) -> _Connection:
        """A connection for one request: an idle one, or a new one (waiting for room if `limit` are open)."""
        idle = self._idle_connection()
        if idle is not None:
            return idle
        if self.open_connections < self.limit:
            self._opening += 1
        else:
            handed = await self._wait_for_room()  # a connection, or room for a new one (counted as opening)
            if handed is not None:
                return handed
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection, self._host, self._port, ssl=self._ssl
                )
        except BaseException:
            self._opening -= 1
            self._let_in(None)  # the room it had goes to the next caller waiting
            raise
        self._opening -= 1
        if self._closed:
            connection._close()
            raise ConnectionError("the pool is closed")
        self.opened += 1
        self._busy.add(connection)
        return connection

    def _idle_connection(self) -> _Connection | None:
        """The most recently used idle connection still usable, taken (those past their use are closed), or None."""
        if self._closed:
            raise ConnectionError("the pool is closed")
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now, self.idle_expiry_s):
                self._busy.add(connection)
                return connection
            connection._close()
        return None

    def release(self, connection: _Connection) -> None:
        """A connection's request is over: handed to the first caller waiting, or kept for the next one if it can
        be reused (else closed, and its room given to a waiting caller)."""
        self._busy.discard(connection)
        if not connection.reusable() or self._closed:
            connection._close()
            self._let_in(None)
            return
        transport = connection.transport
        if transport is not None and not transport.is_reading():  # a read pacer held it, past the answer's end
            transport.resume_reading()
        if self._let_in(connection):
            return
        connection.idle_since = time.monotonic()
        self._idle.append(connection)
        while self._idle and not self._idle[0].usable(connection.idle_since, self.idle_expiry_s):
            self._idle.popleft()._close()  # the oldest ones first: those the servers will close soonest

    def _let_in(self, connection: _Connection | None) -> bool:
        """Hand `connection` (or, with None, room for a new one) to the first caller still waiting; False if none."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            if connection is None:
                self._opening += 1  # reserved for the caller let in: nobody arriving meanwhile takes the room
            else:
                self._busy.add(connection)
            waiter.set_result(connection)
            return True
        return False

    async def _wait_for_room(self) -> _Connection | None:
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.pool_timeout_s):
                handed = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():  # let in, then cancelled before it ran: pass it on
                self._give_back(waiter.result())
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"no connection free within {self.pool_timeout_s:g} s ({self.limit} in use)"
                ) from None
            raise
        if self._closed:
            self._give_back(handed)
            raise ConnectionError("the pool is closed")
        return handed

    def _give_back(self, handed: _Connection | None) -> None:
        """Undo a `_let_in` whose caller will not use what it got."""
        if handed is not None:
            self.release(handed)
        else:
            self._opening -= 1
            self._let_in(None)

    async def aclose(self) -> None:
        """Close every connection; answers in flight fail with `ConnectionError`, and so does every later call."""
        self._closed = True
        for connection in (*self._idle, *self._busy):
            connection._fail(ConnectionResetError("the pool was closed"))
        self._idle.clear()
        while self._let_in(None):  # each caller waiting wakes, sees the close, and gives its room back
            pass
        await asyncio.sleep(0)  # the transports' closes run on the next pass of the loop
