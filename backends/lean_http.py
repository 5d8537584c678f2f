"""Whole-answer POSTs to one replica over kept-alive HTTP/1.1 connections, without a general client's per-call work.

aiohttp's `ClientSession.request` spends about 60 µs of Python on every call (URL and header objects, cookie
filtering, trace hooks, a writer task, timer contexts): a sixth of all the gateway does for a 1–8-token answer,
and half of what dispatching a continuation costs after a weight update. A generation request that waits for its
whole answer needs none of it: one POST of an encoded JSON body to a path known in advance, and one answer framed
by Content-Length or chunked encoding. `KeepAlivePool` writes that request in one socket write on an idle
connection and parses the answer with httptools (llhttp, the parser uvicorn serves with): about 10 µs a call.
Streams and control calls stay on aiohttp (`backends.http_client`).

Failures are the standard library's, for `translate_errors` to map: `ConnectionError` (refused, reset, closed
before the answer ended, the pool closed), `TimeoutError` (connect, pool wait, no answer within the read timeout)
and `ValueError` (an answer that is not HTTP). A request whose answer did not complete (failure, timeout, a
cancelled caller) closes its connection, which the engines take as a client disconnect and abort the request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["IDLE_EXPIRY_S", "KeepAlivePool"]

IDLE_EXPIRY_S = 4.0
"""How long an unused connection is kept. Under the 5 s after which uvicorn (vLLM's and SGLang's server) closes an
idle one, so the pool always gives a connection up first and never sends a request into the server's close."""

_REQUEST = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"


class _Connection(asyncio.Protocol):
    """One socket to the replica: at most one request in flight, its answer parsed as the bytes come."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.framed = False  # the answer's head gave Content-Length or Transfer-Encoding (else the close ends it)
        self.headers_done = False
        self.keep_alive = True
        self.lost = False
        self.idle_since = 0.0
        self.deadline = 0.0  # loop time by which the answer in flight must be complete
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: the connection's state is unknown, give it up
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
        if self.answer is None or self.answer.done():
            return
        if self.headers_done and not self.framed:  # an answer whose end is the connection's close
            self._complete()
            return
        self.answer.set_exception(ConnectionResetError("the replica closed the connection before its answer ended"))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200:  # interim (100 Continue, 103 Early Hints): the answer follows
            self.body.clear()
            self.framed = self.headers_done = False
            return
        self.keep_alive = self.parser.should_keep_alive()
        self._complete()

    # -- the pool's side

    def send(self, request: bytes, deadline: float) -> asyncio.Future[tuple[int, bytes]]:
        """Write one request; the future gets (status, body) once the answer is complete."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.answer = loop.create_future()
        self.body = []
        self.framed = self.headers_done = False
        self.deadline = deadline
        if self._timer is None:  # one timer per connection, moved on only when it fires (see `_check_deadline`)
            self._timer = loop.call_at(deadline, self._check_deadline)
        self.transport.write(request)
        return self.answer

    def usable(self, now: float, idle_expiry_s: float) -> bool:
        return not self.lost and self.keep_alive and now - self.idle_since < idle_expiry_s

    def _check_deadline(self) -> None:
        self._timer = None
        if self.answer is None or self.answer.done():
            return  # idle: the next request arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() < self.deadline:  # a later request than the one that armed it: wait for its own deadline
            self._timer = loop.call_at(self.deadline, self._check_deadline)
            return
        self._fail(TimeoutError("no complete answer within the read timeout"))

    def _complete(self) -> None:
        answer, self.answer = self.answer, None
        body, self.body = self.body, []
        if answer is None or answer.done():  # an answer nobody waits for (a second one in the same bytes, say)
            self._close()
            return
        answer.set_result((self.parser.get_status_code(), b"".join(body)))

    def _fail(self, exc: Exception) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)
        self._close()

    def _close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()


class KeepAlivePool:
    """Kept-alive connections to one replica for request/response POSTs, at most `limit` open at once.

    `post` takes the most recently used idle connection (or opens one), writes the request, and waits for the whole
    answer; callers beyond `limit` wait their turn in order, up to `pool_timeout_s`. A connection unused for
    `idle_expiry_s` is closed instead of reused. Making the pool does no I/O. `url` is the replica's base URL; a path
    in it prefixes every request's path.
    """

    def __init__(
        self,
        url: str,
        limit: int,
        connect_timeout_s: float,
        pool_timeout_s: float,
        read_timeout_s: float,
        idle_expiry_s: float = IDLE_EXPIRY_S,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        if limit < 1:
            raise ValueError(f"a pool needs room for one connection at least, not {limit}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
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
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._idle) + len(self._busy) + self._opening

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST `body` (encoded JSON) to `path`; (status, body) of the whole answer."""
        if self._closed:
            raise ConnectionError("the pool is closed")
        request = _REQUEST % (self._prefix, path.encode(), self._host_header, len(body), body)
        connection = await self._acquire()
        loop = asyncio.get_running_loop()
        answer = connection.send(request, loop.time() + self.read_timeout_s)
        try:
            status, content = await answer
        except BaseException:
            connection._close()  # an answer still on its way (or broken): the connection cannot be reused
            self._release(connection)
            raise
        self._release(connection)
        return status, content

    async def _acquire(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now, self.idle_expiry_s):
                self._busy.add(connection)
                return connection
            connection._close()
        if self.open_connections >= self.limit:
            await self._wait_for_room()
            if self._idle:  # a released connection came back while this caller waited
                return await self._acquire()
        self._opening += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection, self._host, self._port, ssl=self._ssl
                )
        finally:
            self._opening -= 1
        if self._closed:
            connection._close()
            raise ConnectionError("the pool is closed")
        self.opened += 1
        self._busy.add(connection)
        return connection

    async def _wait_for_room(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.pool_timeout_s):
                await waiter
        except TimeoutError:
            raise TimeoutError(f"no connection free within {self.pool_timeout_s:g} s ({self.limit} in use)") from None
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):  # already taken by `_release`
                self._waiters.remove(waiter)
        if self._closed:
            raise ConnectionError("the pool is closed")

    def _release(self, connection: _Connection) -> None:
        self._busy.discard(connection)
        if connection.keep_alive and not connection.lost and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            while self._idle and not self._idle[0].usable(connection.idle_since, self.idle_expiry_s):
                self._idle.popleft()._close()  # the oldest ones first: those the servers will close soonest
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def aclose(self) -> None:
        """Close every connection; answers in flight fail with `ConnectionError`, and so does every later call."""
        self._closed = True
        for connection in (*self._idle, *self._busy):
            connection._fail(ConnectionResetError("the pool was closed"))
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        await asyncio.sleep(0)  # the transports' closes run on the next pass of the loop
