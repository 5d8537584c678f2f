"""How a replica's generation requests travel: `GenerationTransport`, and the plain one over aiohttp
(`AiohttpTransport`). The gateway's fast path supplies its own pool instead (`ReplicaSpec.generation_transport`).

A transport sends one POST of an encoded JSON body to a path of the replica, with any extra headers the request
needs (vLLM's data-parallel rank), and gives the answer whole (`post`) or as it streams (`stream`). Its failures are
ones `translate_errors` maps: aiohttp's client errors, `OSError`, `TimeoutError`, `ValueError`. An answer not read
to its end closes its connection, which the engines take as a client disconnect: they abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Protocol

import aiohttp

__all__ = ["IDLE_EXPIRY_S", "AiohttpTransport", "GenerationTransport", "StreamedReply", "TransportFactory"]

IDLE_EXPIRY_S = 4.0
"""How long an unused connection is kept, by default (`generation.keepalive_expiry_s`). Under the 5 s after which
vLLM and SGLang close an idle one (uvicorn's keep-alive: `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, `SGLANG_TIMEOUT_KEEP_ALIVE`,
5 by default), so the pool gives a connection up first and never sends a request into the server's close. With an
engine (or a proxy in between) set below the expiry that race is possible: such a request fails as a broken
connection (a POST is not retried: the engine may have taken it), the replica is out until its next health probe,
and the request resumes on another one; set the expiry under it."""

_JSON = {"content-type": "application/json"}
_EVENTS = {"content-type": "application/json", "accept": "text/event-stream"}


class StreamedReply(Protocol):
    """An answer read as it streams, within `async with transport.stream(...)`."""

    status: int

    @property
    def transport(self) -> asyncio.Transport | None:
        """The socket being read, for the read pacer to hold between ticks (None: not holdable)."""
        ...

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read, waiting for some; b"" once the answer ended."""
        ...

    async def read_all(self) -> bytes:
        """The rest of the body."""
        ...

    async def __aenter__(self) -> StreamedReply: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class GenerationTransport(Protocol):
    """Generation POSTs to one replica over pooled, kept-alive connections; `headers`: extra request headers."""

    async def post(
        self, path: str, body: bytes, deadline: float | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of the whole answer, complete within the read timeout and, if given, by `deadline` (a
        loop time), else `TimeoutError`."""
        ...

    def stream(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> StreamedReply:
        """The answer as it streams: `async with transport.stream(path, body) as answer`."""
        ...

    async def aclose(self) -> None: ...


TransportFactory = Callable[..., GenerationTransport]
"""Builds a replica's transport: `(url, limit, *, connect_timeout_s, pool_timeout_s, read_timeout_s,
idle_expiry_s)`."""


class _AiohttpStreamed:
    __slots__ = ("_body", "_headers", "_owner", "_path", "_response", "status")

    def __init__(self, owner: AiohttpTransport, path: str, body: bytes, headers: Mapping[str, str]) -> None:
        self._owner = owner
        self._path = path
        self._body = body
        self._headers = headers
        self._response: aiohttp.ClientResponse | None = None
        self.status = 0

    @property
    def transport(self) -> asyncio.Transport | None:
        connection = self._response.connection if self._response is not None else None
        return connection.transport if connection is not None else None

    async def read(self) -> bytes:
        assert self._response is not None, "read within `async with`"
        try:
            return await self._response.content.readany()
        except aiohttp.ClientError as exc:
            self._owner.raise_if_closed(exc)
            raise

    async def read_all(self) -> bytes:
        assert self._response is not None, "read within `async with`"
        return await self._response.read()

    async def __aenter__(self) -> _AiohttpStreamed:
        owner = self._owner
        self._response = await owner.session().post(
            owner.prefix + self._path, data=self._body, headers=self._headers, timeout=owner.stream_timeout
        )
        self._body = b""  # sent: not held for the answer's length
        self.status = self._response.status
        owner.streaming.add(self._response)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        response, self._response = self._response, None
        if response is None:
            return
        self._owner.streaming.discard(response)
        if exc is not None or not response.content.at_eof():
            response.close()  # an answer not read to its end: the connection goes (the engine aborts)
        else:
            response.release()


class AiohttpTransport:
    """`GenerationTransport` over an aiohttp `ClientSession` (made at the first request): at most `limit`
    connections, kept alive for `idle_expiry_s`. A path in `url` prefixes every request's path."""

    def __init__(
        self,
        url: str,
        limit: int,
        *,
        connect_timeout_s: float,
        pool_timeout_s: float,
        read_timeout_s: float,
        idle_expiry_s: float = IDLE_EXPIRY_S,
    ) -> None:
        parts = url.rstrip("/").split("/", 3)
        self._origin = "/".join(parts[:3])
        self.prefix = "/" + parts[3] if len(parts) > 3 else ""
        self._limit = limit
        self._idle_expiry_s = idle_expiry_s
        self._pool_timeout_s = pool_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        # A stream's gaps are timed by its reader (`sse_batches`), not by aiohttp.
        self.stream_timeout = aiohttp.ClientTimeout(total=None, connect=pool_timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.streaming: set[aiohttp.ClientResponse] = set()  # closed with the transport: their readers fail at once

    def session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ConnectionError("the replica's transport was closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=self._idle_expiry_s)
            self._session = aiohttp.ClientSession(  # bodies read raw: ask for no compressed answer
                base_url=self._origin,
                connector=connector,
                auto_decompress=False,
                headers={"accept-encoding": "identity"},
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(
        self, path: str, body: bytes, deadline: float | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        total = self.read_timeout_s
        if deadline is not None:
            total = min(total, deadline - asyncio.get_running_loop().time())
            if total <= 0:  # aiohttp reads a total of 0 as no limit at all
                raise TimeoutError("the request's deadline passed before it was sent")
        timeout = aiohttp.ClientTimeout(total=total, connect=self._pool_timeout_s, sock_connect=self._connect_timeout_s)
        try:
            sent = _JSON if headers is None else {**_JSON, **headers}
            async with self.session().post(self.prefix + path, data=body, headers=sent, timeout=timeout) as response:
                return response.status, await response.read()
        except aiohttp.ClientError as exc:
            self.raise_if_closed(exc)
            raise

    def raise_if_closed(self, exc: Exception) -> None:
        """A failure of a request cut by `aclose` is the transport's closing, not the replica's."""
        if self._closed:
            raise ConnectionError("the replica's transport was closed") from exc

    def stream(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> _AiohttpStreamed:
        return _AiohttpStreamed(self, path, body, _EVENTS if headers is None else {**_EVENTS, **headers})

    async def aclose(self) -> None:
        self._closed = True
        for response in self.streaming:
            response.close()
        self.streaming.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()
